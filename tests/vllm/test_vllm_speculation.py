"""Speculative decoding through the real vLLM: an artifact with a draft model compiled in (fused graph) serves
offline `LLM.generate`, and its greedy tokens equal neuron-infer's NON-speculative generate token for token.

The plugin compiles the artifact itself from vLLM's arguments plus `neuron_infer_build.speculation` (an int8
self-draft of the tiny target, k=3: most blocks fully accepted, so vLLM really receives several tokens per step;
rejections through the runner are covered by tests/vllm/test_runner.py with a weaker draft). fp32 + spread-out tiny logits:
exact identity is required. The worker returns 1..K+1 tokens per request per step; vLLM trims them at max_tokens
and stop strings, which the script also checks (max_tokens that end inside a block).
"""
from __future__ import annotations

import json

import pytest

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig

PROMPTS = [list(range(7, 27)), [5, 9, 33], list(range(100, 160)), [42] * 7]
N = 40
SPEC = {"draft_model": "self", "length": 3, "fused": True, "draft_quant": "int8"}

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompts, n, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache,
                                 "neuron_infer_build": {"speculation": json.loads(spec)},
                                 "neuron_infer_speculation_gate": False})  # reproducible seeded steps
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    res = {"greedy": [o.outputs[0].token_ids for o in
                      llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]}
    short = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 6)]
    res["short"] = [o.outputs[0].token_ids for o in
                    llm.generate([{"prompt_token_ids": prompts[0]}] * 4, short)]
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=n, ignore_eos=True)
    res["seeded"] = [llm.generate([{"prompt_token_ids": prompts[1]}], seeded)[0].outputs[0].token_ids
                     for _ in range(2)]
    with_lp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[2]}], with_lp)
    res["logprobs"] = [{"ids": list(o.outputs[0].token_ids), "logprobs": None if o.outputs[0].logprobs is None else
                        [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]}
                       for o in outs]
    print("RESULT:" + json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def vllm_spec(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    res = run_script(SCRIPT, [str(tiny), str(cache), json.dumps(PROMPTS), str(N), json.dumps(SPEC)], timeout=420)
    (art,) = [p for p in cache.iterdir() if p.is_dir()]
    return res, CompiledModel.load(art, speculation_gate=False)  # its metrics count speculation at fixed k


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "a"
    compile_model(tiny, out, BuildConfig(dtype="fp32", batch_size=1, max_context_length=128, max_length=128),
                  backend="cpu-eager", say=lambda m: None)
    return CompiledModel.load(out)


def test_served_artifact_speculates_with_a_fused_graph(vllm_spec):
    _, art = vllm_spec
    assert art.spec is not None and art.spec.mode == "fused" and art.spec.k == 3


def test_greedy_equals_non_speculative_generate(vllm_spec, plain):
    res, art = vllm_spec
    for prompt, got in zip(PROMPTS, res["greedy"]):
        assert len(got) == N
        assert got == plain.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids
    # the artifact really emits multi-token blocks (else the identity would not exercise them)
    m = art.generate_ids(PROMPTS, N, ignore_eos=True).metrics[0]
    assert m.acceptance_rate > 0.5 and m.mean_accepted_tokens_per_step > 2


def test_max_tokens_inside_an_accepted_block_is_trimmed(vllm_spec, plain):
    res, _ = vllm_spec
    want = plain.generate_ids([PROMPTS[0]], 6, ignore_eos=True).outputs[0].token_ids
    assert res["short"] == [want[:1], want[:2], want[:5], want[:6]]


def test_logprobs_request_takes_plain_steps_and_matches(vllm_spec, plain):
    """A request asking for logprobs next to one that does not: the steps they share are plain (the worker fails
    when a request gets more tokens than logprob records), and both still equal non-speculative generate."""
    res, _ = vllm_spec
    with_lp, without = res["logprobs"]
    want = plain.generate_ids([PROMPTS[0]], N, ignore_eos=True, logprobs=2).outputs[0]
    assert with_lp["ids"] == want.token_ids and len(with_lp["logprobs"]) == N
    assert without["ids"] == plain.generate_ids([PROMPTS[2]], N, ignore_eos=True).outputs[0].token_ids
    assert without["logprobs"] is None
    for pos, w in zip(with_lp["logprobs"], want.logprobs):  # batch-4 target graph vs batch-1: fp32 rounding
        expect = {str(t["token_id"]): t["logprob"] for t in w["top"]} | {str(w["token_id"]): w["logprob"]}
        assert pos == pytest.approx(expect, abs=1e-5)


def test_seeded_sampling_is_reproducible(vllm_spec):
    res, _ = vllm_spec
    a, b = res["seeded"]
    assert a == b and len(a) == N and a != res["greedy"][1]
