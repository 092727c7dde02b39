"""Speculative decoding at tensor-parallel size 2 through the real vLLM: one plugin worker per rank, each running
its target shard and the whole draft (fused graph, int8 self-draft, k=3), compiled by the plugin from vLLM's
arguments plus `neuron_infer_build.speculation`.

fp32: greedy tokens must equal neuron-infer's non-speculative tp-1 generate (speculation is lossless, tensor
parallelism only reorders sums), with several requests decoded together; a seeded sampled request must equal the
same speculative build at tp 1 (every rank draws rank 0's uniforms: runtime/runner.py).
"""
from __future__ import annotations

import json

import pytest

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig, SpeculationConfig

PROMPTS = [list(range(7, 27)), [5, 9, 33], [42] * 7]
N = 24
SPEC = {"draft_model": "self", "length": 3, "fused": True, "draft_quant": "int8"}
SEEDED = SamplingConfig(temperature=0.8, top_k=40, seed=7)

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompts, n, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, tensor_parallel_size=2,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache,
                                 "neuron_infer_build": {"speculation": json.loads(spec)},
                                 "neuron_infer_speculation_gate": False})  # seeded steps as at tp 1
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    res = {"greedy": [o.outputs[0].token_ids for o in
                      llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]}
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=n, ignore_eos=True)
    res["seeded"] = llm.generate([{"prompt_token_ids": prompts[1]}], seeded)[0].outputs[0].token_ids
    print("RESULT:" + json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    res = run_script(SCRIPT, [str(tiny), str(cache), json.dumps(PROMPTS), str(N), json.dumps(SPEC)], timeout=600)
    (art,) = [p for p in cache.iterdir() if p.is_dir()]
    return res, art


def test_the_served_artifact_is_tp2_and_speculative(served):
    from neuron_infer.artifact.manifest import read_manifest

    _, art = served
    build = read_manifest(art, verify_files=False).build
    assert build.tp_degree == 2 and build.speculation is not None and build.speculation.fused


def test_greedy_at_tp2_with_speculation_equals_plain_tp1(served, reference):
    res, _ = served
    for prompt, got in zip(PROMPTS, res["greedy"]):
        assert got == reference.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids


def test_seeded_sampling_at_tp2_equals_speculative_tp1(served, tiny, tmp_path_factory):
    res, _ = served
    out = tmp_path_factory.mktemp("spec1") / "a"
    build = BuildConfig(dtype="fp32", batch_size=4, max_context_length=128, max_length=128,
                        speculation=SpeculationConfig(**SPEC))
    compile_model(tiny, out, build, backend="cpu-eager", say=lambda m: None)
    model = CompiledModel.load(out, speculation_gate=False)  # the server's steps: every one speculative
    want = model.generate_ids([PROMPTS[1]], N, SEEDED, ignore_eos=True).outputs[0].token_ids
    assert res["seeded"] == want
    assert want != res["greedy"][1]  # really sampled
