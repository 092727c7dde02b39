"""Speculative decoding at tp > 1 (the draft whole on every rank, the target sharded): CPU rank processes.

Greedy: the tokens of a tp = 2 / 3 speculative artifact equal the same artifact at tp = 1 and Hugging Face fp32
greedy generation, for the fused graph, the unfused host loop and prompt lookup. Sampled: with a seed the tokens of a
draft model equal tp = 1 (every rank's generator draws tp = 1's numbers and the logits differ only by sharded-sum
rounding; prompt lookup sizes its drafts from measured step times, so it makes no such promise);
without a seed every rank emits the same tokens because the runner agrees on each speculative step's uniforms
(runtime/runner.py), and the same run without that agreement diverges or hangs (so the check has power).

Checkpoint: SmolLM2-shaped heads (9 query / 3 KV heads): tp = 2 pads a query head, tp = 3 splits the KV heads.
"""
from __future__ import annotations

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig, SamplingConfig, SpeculationConfig
from neuron_infer.parallel.launch import RankFailure, run_ranks
from tests.parallel import toy_workers as tw
from tests.parallel.test_tp_e2e import SMOL_LIKE
from tests.test_generate import hf_greedy
from tests.tiny_checkpoint import write_tiny_checkpoint

BUILD = BuildConfig(dtype="fp32", max_context_length=32, max_length=64, context_buckets=(32,),
                    tokengen_buckets=(64,), batch_size=2)
# the second prompt repeats itself, so prompt lookup finds drafts
PROMPTS = [[1, 17, 42, 99, 7, 250, 31], [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW = 16
SPECS = {
    "fused": SpeculationConfig("self", 3, fused=True, draft_quant="int8"),  # whole target in int8: most accepted
    "unfused": SpeculationConfig("self", 3, fused=False, draft_layers=1),   # first layer: many rejections
    "ngram": SpeculationConfig("ngram", 3),
}
SEEDED = SamplingConfig(temperature=0.8, seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tpspec") / "smol_like", **SMOL_LIKE)


@pytest.fixture(scope="module")
def arts(ckpt, tmp_path_factory):
    """(spec name, tp) -> artifact dir (cpu-eager, compiled once per module)."""
    root, cache = tmp_path_factory.mktemp("tpspec_arts"), {}

    def get(spec: str, tp: int):
        if (spec, tp) not in cache:
            out = root / f"{spec}_tp{tp}"
            compile_model(ckpt, out, BUILD.replace(tp_degree=tp, speculation=SPECS[spec]), backend="cpu-eager",
                          say=lambda m: None)
            cache[spec, tp] = out
        return cache[spec, tp]

    return get


@pytest.fixture(scope="module")
def hf_tokens(ckpt):
    return [hf_greedy(ckpt, p, NEW) for p in PROMPTS]


def run(art) -> tuple[list[list[int]], list[list[int]], object]:
    """(greedy tokens, seeded sampled tokens, greedy metrics) of one artifact. Ungated: the speculation gate chooses
    plain or speculative steps from measured times, and seeded sampling draws differently on each kind of step."""
    with CompiledModel.load(art, speculation_gate=False) as m:
        greedy = m.generate_ids(PROMPTS, NEW, ignore_eos=True)
        sampled = m.generate_ids(PROMPTS, NEW, SEEDED, ignore_eos=True)
    return [o.token_ids for o in greedy.outputs], [o.token_ids for o in sampled.outputs], greedy.metrics[0]


@pytest.mark.parametrize("spec,tp", [("fused", 2), ("fused", 3), ("unfused", 2), ("unfused", 3), ("ngram", 2)])
def test_tp_speculation_equals_tp1_and_hugging_face(arts, hf_tokens, spec, tp):
    ref_greedy, ref_sampled, _ = run(arts(spec, 1))
    greedy, sampled, metrics = run(arts(spec, tp))
    assert ref_greedy == hf_tokens                      # tp = 1 speculation is lossless (the reference is right)
    assert greedy == hf_tokens
    assert metrics.spec_steps > 0 and metrics.mode == ("ngram" if spec == "ngram" else spec)
    if spec == "fused":
        assert metrics.accepted > 0                     # multi-token blocks ran through the ranks
    if spec != "ngram":  # prompt lookup's draft lengths follow measured step times: seeded runs differ even at tp 1
        assert sampled == ref_sampled


@pytest.mark.parametrize("spec,temperature,new", [("fused", 0.9, NEW), ("ngram", 0.2, 40)])
def test_unseeded_sampling_gives_every_rank_the_same_tokens(arts, spec, temperature, new):
    """Prompt lookup drafts only where the text repeats itself: the random model's samples at temperature 0.9 rarely
    do within 16 tokens (no speculative step at all in some runs); at 0.2 over 40 tokens they fall into loops."""
    out = run_ranks(tw.rank_sampled_tokens, 2, (str(arts(spec, 2)), PROMPTS, new, True, temperature), timeout_s=300)
    assert out["spec_steps"] > 0
    first, second = out["tokens"]
    assert first == second


HANG_S = 30  # the broken runs below either finish (in seconds) or hang in a collective


def test_without_agreeing_on_the_uniforms_the_ranks_diverge(arts):
    """Each rank drafts from its own uniforms: their tokens differ or, once their steps stop lining up (one rank
    accepts more tokens and stops earlier, or takes a plain step), their collectives hang (RankFailure). A run that
    completes takes a few seconds here, so a hang is named after HANG_S."""
    try:
        out = run_ranks(tw.rank_sampled_tokens, 2, (str(arts("fused", 2)), PROMPTS, NEW, False), timeout_s=HANG_S)
    except RankFailure as e:
        assert "hung" in str(e)
        return
    first, second = out["tokens"]
    assert first != second


def test_ranks_take_rank_0s_gate_decision(arts, hf_tokens):
    """Each rank times its own steps; scripted here so that rank 0's speculative steps never pay and rank 1's always
    do. Every rank follows rank 0 (the same plain, probe and speculative steps, the same tokens), and without agreeing
    on the gate's decision the ranks' steps stop lining up (their collectives hang or their tokens differ)."""
    out = run_ranks(tw.rank_gated_tokens, 2, (str(arts("fused", 2)), PROMPTS, NEW), timeout_s=300)
    first, second = out["tokens"]
    assert first == second == hf_tokens
    assert out["steps"][0] == out["steps"][1] and out["steps"][1][2] > 0  # rank 1 took rank 0's plain steps
    try:
        broken = run_ranks(tw.rank_gated_tokens, 2, (str(arts("fused", 2)), PROMPTS, NEW, False), timeout_s=HANG_S)
    except RankFailure:
        return
    assert broken["steps"][0] != broken["steps"][1] or broken["tokens"][0] != broken["tokens"][1]

