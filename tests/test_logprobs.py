"""Logprobs: each output token's log-probability and top-N alternatives, against a NumPy log-softmax of the logits
the runner sampled from; `--logprobs N` in `generate --json`; speculation falls back to plain steps for them."""
import json

import numpy as np
import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import make_generator
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.sequence import Sequence, StopRule, shared_rule
from tests.test_cli_generate_io import run_main
from tests.tiny_artifact import compile_tiny


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("lp") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20, seed=3)])
def test_logprobs_match_a_numpy_log_softmax_of_the_sampled_logits(model, sampling):
    seen = []
    ids = model.encode("The capital")
    res, _ = generate_ids(model.engine, [ids], 8, sampling, (), True,
                          on_logits=lambda lg: seen.append(lg.clone()), logprobs=4)
    for row, r in enumerate(res):  # seen[step]: the logits [1, V] the step sampled from
        assert len(r.logprobs) == len(r.token_ids) == 8
        for step, (tok, rec) in enumerate(zip(r.token_ids, r.logprobs)):
            ref = _np_log_softmax(seen[step][row].numpy())
            # tolerance: fp32 log-softmax in torch vs float64 in NumPy over a small vocabulary
            assert rec["token_id"] == tok and rec["logprob"] == pytest.approx(ref[tok], abs=1e-5)
            assert rec["rank"] == int((ref >= ref[tok]).sum())  # 1 = most likely (vLLM's rank)
            top = np.argsort(-ref, kind="stable")[:4]
            assert [i for i, _ in rec["top"]] == top.tolist()
            assert [v for _, v in rec["top"]] == pytest.approx(ref[top].tolist(), abs=1e-5)
        if sampling.greedy:
            assert all(rec["top"][0][0] == rec["token_id"] for rec in r.logprobs)


def test_logprobs_do_not_change_the_tokens(model):
    s = SamplingConfig(temperature=0.9, seed=7)
    a = model.generate(["a", "b"], 10, s, ignore_eos=True)
    b = model.generate(["a", "b"], 10, s, ignore_eos=True, logprobs=2)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].logprobs is None and len(b.outputs[0].logprobs) == 10


def test_cli_json_logprobs_carry_token_text(art, model):
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--max-new-tokens", "6", "--ignore-eos",
                               "--json", "--logprobs", "3"])
    assert code == 0, err
    o = json.loads(out)["outputs"][0]
    assert len(o["logprobs"]) == len(o["token_ids"]) == 6
    for tok, rec in zip(o["token_ids"], o["logprobs"]):
        assert rec["token_id"] == tok and rec["token"] == model.tokenizer.decode([tok]) and rec["logprob"] <= 0
        assert len(rec["top"]) == 3 and all(t["token"] == model.tokenizer.decode([t["token_id"]]) for t in rec["top"])
        assert [t["logprob"] for t in rec["top"]] == sorted((t["logprob"] for t in rec["top"]), reverse=True)


def test_cli_logprobs_without_json_is_one_error_line(art):
    code, _, err = run_main(["generate", str(art), "--prompt", "a", "--logprobs", "2"])
    assert code == 2 and err.strip().startswith("error:") and "--json" in err and "Traceback" not in err


def test_a_sequence_asking_for_logprobs_takes_plain_steps():
    def mk(lp):
        return Sequence(0, [1], SamplingConfig(), StopRule(4), make_generator(0), logprobs=lp)

    assert shared_rule([mk(None), mk(None)]) is not None
    assert shared_rule([mk(None), mk(2)]) is None
