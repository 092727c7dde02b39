"""Offline `vllm.LLM.generate` through the plugin vs neuron-infer's own generate and Hugging Face (greedy).

vLLM runs in a fresh interpreter (its engine core and worker are spawned processes and a platform is chosen once
per process); the script prints its results as JSON and the tests compare them here. The plugin compiles the
artifact on first use from vLLM's arguments (cache dir under tmp), so this module covers that path; the server
tests cover explicitly given artifacts.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from transformers import LlamaForCausalLM

from neuron_infer.config import SamplingConfig

PROMPTS = [list(range(7, 27)), [5, 9, 33], list(range(100, 160))]
N = 24
SEEDED = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, seed=1234)

SCRIPT = r"""
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform


def where(worker):
    import torch
    return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


if __name__ == "__main__":
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (the test's own)
    model, cache, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    # 16-token blocks and a 32-token step budget: vLLM splits the 60-token prompt into chunks (chunked prefill) and
    # finds the shared prompt's first blocks in its prefix cache
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, enable_chunked_prefill=True, max_num_batched_tokens=32,
              enable_prefix_caching=True, disable_log_stats=False,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache,
                                 "neuron_infer_build": {"kv_block_size": 16}})
    res = {"platform": type(current_platform).__name__, "front": {"pid": os.getpid(),
                                                                   "cpus": sorted(os.sched_getaffinity(0))}}
    res["workers"] = llm.collective_rpc(where)
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    res["greedy"] = [o.outputs[0].token_ids for o in outs]
    shared = prompts[2][:48] + [5, 6, 7]  # the first three blocks of the 60-token prompt, sent above
    res["shared"] = llm.generate([{"prompt_token_ids": shared}], greedy)[0].outputs[0].token_ids
    res["prefix_cache"] = {m.name: m.value for m in llm.get_metrics()
                           if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    res["text_prompt_ids"] = text[0].prompt_token_ids
    res["text"] = {"ids": text[0].outputs[0].token_ids, "text": text[0].outputs[0].text,
                   "finish": text[0].outputs[0].finish_reason}
    stop = text[0].outputs[0].text[4:7]
    st = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))
    res["stop"] = {"stop": stop, "text": st[0].outputs[0].text, "finish": st[0].outputs[0].finish_reason}
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=n, ignore_eos=True)
    res["seeded"] = [llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0].outputs[0].token_ids
                     for _ in range(2)]
    try:
        llm.generate(["hi"], SamplingParams(max_tokens=2, bad_words=["the"]))
        res["unsupported_error"] = None
    except Exception as e:
        res["unsupported_error"] = f"{type(e).__name__}: {e}"
    print("RESULT:" + json.dumps(res), flush=True)
"""


SMALL_CACHE_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompts, n, gib = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, disable_log_stats=False,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache,
                                 "neuron_infer_build": {"kv_block_size": 16}, "neuron_infer_kv_cache_gib": float(gib)})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    res = {"greedy": [o.outputs[0].token_ids for o in outs],
           "preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")}
    print("RESULT:" + json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def plugin_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # both scripts build the same artifact: the second run loads it


@pytest.fixture(scope="module")
def vllm_result(tiny, plugin_cache):
    return run_script(SCRIPT, [str(tiny), str(plugin_cache), json.dumps(PROMPTS), str(N)], timeout=420)


def test_a_cache_too_small_for_the_batch_preempts_and_every_request_still_equals_neuron_infer(
        tiny, plugin_cache, reference, vllm_result):
    """A KV cache of 10 blocks of 16 tokens (9 usable: one 128-token request and a bit): four requests of 60 + 40
    tokens need 7 blocks each, so vLLM preempts requests when blocks run out and resumes them later; the worker
    encodes a resumed request again in the blocks vLLM gives it, and every output equals neuron-infer's own."""
    block_bytes = 2 * 2 * 2 * 16 * 32 * 4  # K and V x 2 layers x 2 KV heads x 16 positions x head dim 32 x fp32
    prompts = [[(i * 31 + j * 7) % 400 + 10 for j in range(60)] for i in range(4)]
    got = run_script(SMALL_CACHE_SCRIPT, [str(tiny), str(plugin_cache), json.dumps(prompts), "40",
                                          repr(10 * block_bytes / 2**30)], timeout=420)
    assert got["preemptions"] > 0
    for prompt, toks in zip(prompts, got["greedy"]):
        assert toks == reference.generate_ids([prompt], 40, ignore_eos=True).outputs[0].token_ids


def hf_greedy(model_dir, prompt, n):
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_chunked_prompts_and_prefix_cache_hits_equal_neuron_infer(vllm_result, reference):
    """The 60-token prompt came in chunks of at most 32 tokens; the shared one found its first 48 tokens in vLLM's
    prefix cache (blocks the 60-token prompt's request wrote) and encoded only the rest."""
    shared = PROMPTS[2][:48] + [5, 6, 7]
    assert vllm_result["shared"] == reference.generate_ids([shared], N, ignore_eos=True).outputs[0].token_ids
    assert vllm_result["prefix_cache"]["vllm:prefix_cache_hits"] >= 48


def test_plugin_platform_is_selected(vllm_result):
    assert vllm_result["platform"] == "NeuronInferPlatform"


def test_one_rank_worker_runs_in_the_engine_process_on_every_allowed_cpu(vllm_result):
    """One worker (vLLM's single-worker executor) in the engine-core process, not pinned by vLLM's CPU binding: it
    may use every CPU the front end may (vLLM's multiprocess default pins its worker to the CPUs it does not reserve,
    one of two on a 2-core machine)."""
    (worker,) = vllm_result["workers"]
    assert worker["pid"] != vllm_result["front"]["pid"]  # vLLM's engine-core process, spawned by the front end
    assert worker["cpus"] == vllm_result["front"]["cpus"]
    assert 1 <= worker["threads"] <= len(worker["cpus"])


def test_greedy_equals_neuron_infer_and_hf(vllm_result, reference, tiny):
    for prompt, got in zip(PROMPTS, vllm_result["greedy"]):
        assert len(got) == N
        assert got == reference.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids
        assert got == hf_greedy(tiny, prompt, N)


def test_text_prompt_and_max_tokens(vllm_result, reference):
    r = vllm_result["text"]
    assert r["finish"] == "length" and len(r["ids"]) == 12
    assert vllm_result["text_prompt_ids"] == reference.encode("The capital of France is")
    assert r["ids"] == reference.generate(["The capital of France is"], 12, ignore_eos=True).outputs[0].token_ids


def test_stop_string_truncates(vllm_result):
    full, r = vllm_result["text"]["text"], vllm_result["stop"]
    assert r["stop"] and r["finish"] == "stop"
    assert r["text"] == full[: full.index(r["stop"])]


def test_seeded_sampling_is_reproducible_and_matches_neuron_infer(vllm_result, reference):
    a, b = vllm_result["seeded"]
    assert a == b and len(a) == N
    assert a == reference.generate_ids([PROMPTS[0]], N, SEEDED, ignore_eos=True).outputs[0].token_ids
    assert a != vllm_result["greedy"][0]  # really sampled (temperature 0.9 on spread-out logits)


def test_unsupported_feature_is_rejected_with_reason(vllm_result):
    assert "does not support bad_words=['the']" in (vllm_result["unsupported_error"] or "")
