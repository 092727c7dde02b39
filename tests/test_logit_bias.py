"""min_tokens and logit_bias in the one sampling definition, against a per-row NumPy reference and Hugging Face's
logits processors; through the API and the CLI on a tiny artifact; speculation takes plain steps for them."""
import json

import numpy as np
import pytest
import torch

from neuron_infer.api import CompiledModel
from neuron_infer.cli_help import parse_logit_bias
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ConfigError, NeuronInferError
from neuron_infer.model.sampling import (
    check_vocab,
    logit_adjustment,
    processed_probs,
    rows_params,
    sample_rows,
    token_history,
    unpack_bitmask,
)
from neuron_infer.runtime.sequence import Sequence, StopRule, shared_rule
from tests.test_cli_generate_io import run_main
from tests.test_penalties import np_reference as penalties_reference
from tests.tiny_artifact import compile_tiny

V = 12
CONFIGS = [SamplingConfig(temperature=0.7, logit_bias={3: 2.5, 7: -1.0}, repetition_penalty=1.3),
           SamplingConfig(temperature=1.0, min_tokens=4, top_k=5),
           SamplingConfig(temperature=0.9, min_tokens=1, logit_bias={0: 100.0}, presence_penalty=0.5),
           SamplingConfig(logit_bias={2: -100.0}, min_tokens=3)]  # greedy
PROMPTS, OUTPUTS = [[1, 2, 3], [4, 4], [0], [5, 6]], [[3, 3], [], [8, 8, 8], [6, 6, 6]]
STOPS = [(11,), (10, 11), (0,), (9,)]  # per row: the ids min_tokens holds back


def np_reference(logits, c, prompt, output, stops):
    """One row, plain NumPy float64: bias and min_tokens, then the penalties reference (penalties, temperature,
    min-p, top-k, renormalize)."""
    x = logits.astype(np.float64).copy()
    for t, b in c.logit_bias:
        x[t] += b
    if len(output) < c.min_tokens:
        x[list(stops)] = -np.inf
    return penalties_reference(x, c, prompt, output)


def _bias(configs=CONFIGS, outputs=OUTPUTS, stops=STOPS):
    return logit_adjustment(configs, [len(o) for o in outputs], stops, V)


def test_processed_probs_with_bias_and_min_tokens_match_a_per_row_numpy_reference():
    logits = torch.randn(len(CONFIGS), V, generator=torch.Generator().manual_seed(0)) * 3
    got = processed_probs(logits, rows_params(CONFIGS), True, token_history(PROMPTS, OUTPUTS, V), _bias())
    for i, c in enumerate(CONFIGS):
        want = np_reference(logits[i].numpy(), c, PROMPTS[i], OUTPUTS[i], STOPS[i])
        # tolerance: fp32 softmax against float64 over 12 tokens
        np.testing.assert_allclose(got[i].numpy(), want, atol=1e-6)


def test_min_tokens_holds_back_the_stop_ids_only_while_the_output_is_shorter():
    bias = _bias()
    assert torch.isinf(bias[1, [10, 11]]).all() and torch.isfinite(bias[1, :10]).all()  # 0 of 4 generated
    assert bias[3, 9] == 0 and bias[3, 2] == -100.0  # 3 generated = min_tokens 3: no longer held back
    assert torch.isfinite(bias[2]).all() and bias[2, 0] == 100.0  # 3 generated >= min_tokens 1
    assert logit_adjustment([SamplingConfig(min_tokens=2)], [2], [(1,)], V) is None  # reached: nothing to add
    assert logit_adjustment([SamplingConfig()], [0], [(1,)], V) is None


def test_bias_and_min_tokens_match_hugging_face():
    tf = pytest.importorskip("transformers")
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 2
    ids = torch.tensor([[1, 2, 3], [0, 5, 9]])  # prompts of 2 tokens, one generated
    c = SamplingConfig(temperature=1.0, logit_bias={4: 1.5, 6: -3.0}, min_tokens=3)
    hf = tf.SequenceBiasLogitsProcessor(sequence_bias=[[[4], 1.5], [[6], -3.0]])(ids, logits.clone())
    hf = tf.MinNewTokensLengthLogitsProcessor(2, 3, eos_token_id=[11])(ids, hf)
    want = torch.softmax(hf, -1)
    got = processed_probs(logits, rows_params([c, c]), True, None, logit_adjustment([c, c], [1, 1], [(11,)] * 2, V))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)  # same fp32 math, different op order


def test_greedy_rows_take_the_argmax_of_the_biased_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    cs = [SamplingConfig(logit_bias={0: -2.0}), SamplingConfig(min_tokens=1)]
    bias = logit_adjustment(cs, [0, 0], [(), (0, 1)], 3)
    assert sample_rows(logits, cs, None, None, bias).tolist() == [1, 2]
    assert sample_rows(logits, [SamplingConfig()] * 2, None).tolist() == [0, 0]


def test_sampled_rows_never_choose_a_held_back_or_minus_100_token():
    logits = torch.zeros(64, V)  # uniform: every token would be likely
    cs = [SamplingConfig(temperature=1.0, min_tokens=5, logit_bias={3: -100.0})] * 64
    bias = logit_adjustment(cs, [0] * 64, [(0, 1)] * 64, V)
    toks = sample_rows(logits, cs, torch.rand(64, generator=torch.Generator().manual_seed(4)), None, bias)
    assert not set(toks.tolist()) & {0, 1}
    assert 3 not in toks.tolist()  # exp(-100) of the mass: never drawn in 64 tries


@pytest.mark.parametrize("kw,match", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"logit_bias": {3: 101.0}}, "in \\[-100, 100\\]"), ({"logit_bias": {3: float("nan")}}, "logit_bias value"),
    ({"logit_bias": {-1: 1.0}}, "token id -1"), ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "token 1 more than once"),
    ({"logit_bias": [(1, 1.0, 2)]}, "pair"), ({"logit_bias": {True: 1.0}}, "token id True"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingConfig(**kw)


def test_logit_bias_is_stored_sorted_and_round_trips_through_json():
    c = SamplingConfig(logit_bias={9: -1, 2: 0.5}, min_tokens=2)
    assert c.logit_bias == ((2, 0.5), (9, -1.0)) and c.biased
    assert SamplingConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ConfigError, match="vocabulary 0..8"):
        check_vocab(c, 9)
    check_vocab(c, 10)


def test_cli_logit_bias_values_are_parsed_or_named():
    assert parse_logit_bias(("2:-100", "7:1.5")) == ((2, -100.0), (7, 1.5))
    for bad in ("2", "x:1", "2:y", ":3"):
        with pytest.raises(NeuronInferError, match="TOKEN_ID:BIAS"):
            parse_logit_bias((bad,))


def test_stop_strings_are_not_looked_for_within_min_tokens():
    rule = StopRule(None, (), False, None, ("b",), lambda ids: "".join("ab"[i] for i in ids))
    s = Sequence(0, [0], SamplingConfig(min_tokens=2), rule, None)
    assert s.append([1, 1]) == [1, 1] and not s.finished  # "bb": within the first two tokens
    assert s.append([1]) == [1] and s.finish_reason == "stop"


def test_held_ids_are_eos_unless_ignored_or_given():
    assert Sequence(0, [0], SamplingConfig(), StopRule(eos_ids=(4, 5)), None).held_ids == (4, 5)
    assert Sequence(0, [0], SamplingConfig(), StopRule(eos_ids=(4,), ignore_eos=True), None).held_ids == ()
    assert Sequence(0, [0], SamplingConfig(), StopRule(), None, stop_ids=(7,)).held_ids == (7,)


def test_logit_bias_and_min_tokens_take_plain_steps_under_speculation():
    def seqs(c, out=()):
        return [Sequence(i, [1], c, StopRule(9), torch.Generator(), output=list(out)) for i in range(2)]
    assert shared_rule(seqs(SamplingConfig(logit_bias={2: 1.0}))) is None
    assert shared_rule(seqs(SamplingConfig(min_tokens=2), [5])) is None  # 1 < 2 generated
    assert shared_rule(seqs(SamplingConfig(min_tokens=2), [5, 5])) is not None  # reached: speculation resumes


# ---- through the API and the CLI on a tiny artifact ----------------------------------------------------------------
@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("bias") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def test_logit_bias_steers_greedy_and_sampled_generation(model):
    ref = model.generate_ids([[5, 9, 14]], 6, ignore_eos=True).outputs[0].token_ids
    away = model.generate_ids([[5, 9, 14]], 6, SamplingConfig(logit_bias={ref[0]: -100.0}), ignore_eos=True)
    assert ref[0] not in away.outputs[0].token_ids
    for c in (SamplingConfig(logit_bias={17: 100.0}), SamplingConfig(temperature=1.0, seed=0, logit_bias={17: 100})):
        assert model.generate_ids([[5, 9, 14]], 6, c, ignore_eos=True).outputs[0].token_ids == [17] * 6
    with pytest.raises(ConfigError, match="logit_bias names token id 99999"):
        model.generate_ids([[5]], 2, SamplingConfig(logit_bias={99999: 1.0}))


def test_min_tokens_defers_eos(model, monkeypatch):
    ref = model.generate_ids([[5, 9, 14]], 8, ignore_eos=True).outputs[0].token_ids
    eos = ref[1]
    monkeypatch.setattr(model, "eos_ids", (eos,))
    early = model.generate_ids([[5, 9, 14]], 8).outputs[0]
    assert early.finish_reason == "eos" and len(early.token_ids) <= 2
    late = model.generate_ids([[5, 9, 14]], 8, SamplingConfig(min_tokens=5)).outputs[0]
    assert len(late.token_ids) >= 5 and eos not in late.token_ids[:5]
    # the first five tokens are those of a run where the EOS id is biased away entirely
    banned = model.generate_ids([[5, 9, 14]], 5, SamplingConfig(logit_bias={eos: -100.0}), ignore_eos=True)
    assert late.token_ids[:5] == banned.outputs[0].token_ids


def test_cli_min_tokens_and_logit_bias(art, model):
    ref = model.generate_ids([model.encode("a")], 4, SamplingConfig(logit_bias={17: 100.0}), ignore_eos=True)
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--max-new-tokens", "4", "--json",
                               "--min-tokens", "4", "--logit-bias", "17:100"])
    assert code == 0, err
    o = json.loads(out)["outputs"][0]
    assert o["token_ids"] == ref.outputs[0].token_ids == [17] * 4
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--logit-bias", "17=1"])
    assert code == 2 and err.strip().startswith("error: --logit-bias '17=1' must be TOKEN_ID:BIAS")
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--logit-bias", "17:300"])
    assert code == 2 and "error:" in err and "[-100, 100]" in err and "Traceback" not in err


# ---- a grammar's token mask (structured outputs: vLLM's per-step bitmask) ----------------------------------------
def test_unpack_bitmask_matches_a_per_bit_reference():
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(3, 2), dtype=np.int64).astype(np.int32)  # [3, 2]: 64 bits
    words[0] = [-1, 0]  # all of 0..31, none of 32..63 (bit 31 is the sign bit)
    got = unpack_bitmask(words, 40)
    want = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(40)] for r in range(3)]
    assert got.tolist() == want and got.shape == (3, 40)
    assert got[0, :32].all() and not got[0, 32:].any()


def test_a_mask_restricts_greedy_and_sampled_rows_and_clears_after_one_token():
    logits = torch.zeros(64, V)
    logits[:, 0] = 5.0  # the unconstrained favourite
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[3, 7]] = True
    cs = [SamplingConfig(temperature=1.0)] * 63 + [SamplingConfig()]
    bias = logit_adjustment(cs, [0] * 64, [()] * 64, V, [allowed] * 64)
    u = torch.rand(64, generator=torch.Generator().manual_seed(5))
    toks = sample_rows(logits, cs, u, None, bias)
    assert set(toks.tolist()) == {3, 7}  # both allowed tokens drawn, nothing else
    s = Sequence(0, [1], SamplingConfig(), StopRule(), torch.Generator())
    s.allowed = allowed
    assert shared_rule([s]) is None  # a constrained sequence takes plain steps


def test_slot_runner_applies_a_mask_to_one_step(model):
    from neuron_infer.vllm_plugin.runner import SlotRunner

    runner = SlotRunner(model.engine)
    v = model.engine.vocab_size
    ref = model.generate_ids([[5, 9, 14]], 3, ignore_eos=True).outputs[0].token_ids
    only = torch.zeros(v, dtype=torch.bool)
    only[17] = True
    runner.join("r", [5, 9, 14], SamplingConfig(), blocks=[1])
    runner.constrain("r", only)
    assert runner.encode({"r": 3}) == {"r": [17]}  # the prefill's token, masked
    assert runner.slots["r"].allowed is None
    nxt = runner.decode(["r"])["r"]
    alone = model.generate_ids([[5, 9, 14, 17]], 1, ignore_eos=True).outputs[0].token_ids
    assert nxt == alone and ref[0] != 17  # unconstrained again (and the mask really changed the first token)
    runner.release("r")
