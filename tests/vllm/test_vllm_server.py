"""vLLM's OpenAI server through the plugin, serving an explicitly given artifact (additional_config).

One server per module (tiny fp32 model, batch 8, eager graphs), started on 127.0.0.1 in its own process group and
always killed in the fixture's finally. The last test stops it with SIGTERM and checks that the whole process
group (API server, engine core, worker) is gone.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.vllm.vllm_helpers import TINY_VLLM, Server, get, post, require_vllm

require_vllm()

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.vllm.test_bench_serving import assert_loaded_equals_alone, bench

BATCH = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    model = write_tiny_checkpoint(root / "tiny", **TINY_VLLM)
    art = root / "art"
    build = BuildConfig(dtype="fp32", batch_size=BATCH, max_context_length=128, max_length=128, kv_block_size=16)
    compile_model(model, art, build, backend="cpu-eager", say=lambda m: None)
    server = Server(model, ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", str(BATCH),
                            "--gpu-memory-utilization", "0.3", "--enforce-eager", "--served-model-name", "tiny",
                            "--additional-config", json.dumps({"neuron_infer_artifacts": str(art)})],
                    root / "server.log")
    try:
        server.wait_ready()
        yield server, CompiledModel.load(art)
    finally:
        server.kill()


def complete(server, **body):
    status, data = post(server.url + "/v1/completions", {"model": "tiny", "temperature": 0.0, **body})
    assert status == 200, data
    return data["choices"][0]


def test_greedy_completion_equals_neuron_infer(setup):
    server, ours = setup
    for prompt in (list(range(7, 27)), [5, 9, 33]):
        got = complete(server, prompt=prompt, max_tokens=20, ignore_eos=True, return_token_ids=True)
        assert got["token_ids"] == ours.generate_ids([prompt], 20, ignore_eos=True).outputs[0].token_ids
        assert got["finish_reason"] == "length"


def test_streaming_equals_non_streaming(setup):
    server, _ = setup
    cfg = bench.BenchConfig(base_url=server.url, model="tiny", num_requests=2, concurrency=1, input_len=12,
                            output_len=16, stream=True, timeout_s=120)
    _, streamed = bench.run_benchmark(cfg)
    for spec, rec in zip(bench.make_requests(cfg), streamed):
        assert rec.error is None and rec.output_tokens == 16 and len(rec.chunk_times) > 1
        whole = complete(server, prompt=spec.prompt, max_tokens=16, ignore_eos=True, return_token_ids=True)
        assert rec.token_ids == whole["token_ids"] and rec.text == whole["text"]


def test_stop_string_and_max_tokens(setup):
    server, _ = setup
    full = complete(server, prompt="The capital of France is", max_tokens=12, ignore_eos=True)
    assert full["finish_reason"] == "length"
    stop = full["text"][4:7]
    cut = complete(server, prompt="The capital of France is", max_tokens=12, stop=[stop])
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]
    short = complete(server, prompt="The capital of France is", max_tokens=3, ignore_eos=True, return_token_ids=True)
    assert len(short["token_ids"]) == 3 and short["finish_reason"] == "length"


def test_chat_completion(setup):
    server, ours = setup
    status, data = post(server.url + "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                         "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, data
    choice = data["choices"][0]
    prompt_ids = ours.encode("Hello", chat=True)
    assert choice["token_ids"] == ours.generate_ids([prompt_ids], 8, ignore_eos=True).outputs[0].token_ids


def test_unsupported_request_gets_400_with_reason(setup):
    server, _ = setup
    status, data = post(server.url + "/v1/completions",
                        {"model": "tiny", "prompt": "hi", "max_tokens": 2, "allowed_token_ids": [5, 6]})
    assert status == 400 and "does not support allowed_token_ids=[5, 6]" in json.dumps(data)
    status, data = post(server.url + "/v1/completions",
                        {"model": "tiny", "prompt": "hi", "max_tokens": 2, "bad_words": ["the"]})
    assert status == 400 and "does not support bad_words=['the']" in json.dumps(data)
    ok = complete(server, prompt="hi", max_tokens=2)  # the server keeps serving
    assert ok["finish_reason"] in ("length", "stop")


def token_id(placeholder: str) -> int:
    """`return_tokens_as_token_ids` names tokens "token_id:<id>" (exact ids, no text collisions)."""
    assert placeholder.startswith("token_id:"), placeholder
    return int(placeholder.removeprefix("token_id:"))


def test_completion_logprobs(setup):
    """`logprobs: 3` on /v1/completions: per token its logprob and a dict of the top 3 (+ the sampled token), equal
    to neuron-infer's own generate on the same artifact (same fp32 graphs, another batch row: 1e-5)."""
    server, ours = setup
    prompt = list(range(7, 27))
    got = complete(server, prompt=prompt, max_tokens=8, ignore_eos=True, logprobs=3, return_token_ids=True,
                   return_tokens_as_token_ids=True)
    want = ours.generate_ids([prompt], 8, ignore_eos=True, logprobs=3).outputs[0]
    lp = got["logprobs"]
    assert [token_id(t) for t in lp["tokens"]] == got["token_ids"] == want.token_ids
    assert lp["token_logprobs"] == pytest.approx([w["logprob"] for w in want.logprobs], abs=1e-5)
    assert len(lp["text_offset"]) == len(lp["top_logprobs"]) == 8
    for top, w in zip(lp["top_logprobs"], want.logprobs):
        expect = {t["token_id"]: t["logprob"] for t in w["top"]} | {w["token_id"]: w["logprob"]}
        assert {token_id(t): v for t, v in top.items()} == pytest.approx(expect, abs=1e-5)


def test_chat_completion_logprobs(setup):
    """`logprobs: true, top_logprobs: 2` on /v1/chat/completions: each content entry carries its token's logprob
    and exactly 2 alternatives, most likely first."""
    server, ours = setup
    status, data = post(server.url + "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                         "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "logprobs": True,
                         "top_logprobs": 2, "return_tokens_as_token_ids": True})
    assert status == 200, data
    choice = data["choices"][0]
    want = ours.generate_ids([ours.encode("Hello", chat=True)], 6, ignore_eos=True, logprobs=2).outputs[0]
    content = choice["logprobs"]["content"]
    assert [token_id(c["token"]) for c in content] == choice["token_ids"] == want.token_ids
    for c, w in zip(content, want.logprobs):
        assert c["logprob"] == pytest.approx(w["logprob"], abs=1e-5) and c["logprob"] <= 0
        assert [token_id(t["token"]) for t in c["top_logprobs"]] == [t["token_id"] for t in w["top"]]
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx([t["logprob"] for t in w["top"]], abs=1e-5)


def test_load_32_mixed_requests_concurrency_8_equal_alone(setup):
    server, _ = setup
    assert_loaded_equals_alone(bench.BenchConfig(base_url=server.url, model="tiny", num_requests=32, concurrency=8,
                                                 input_len=3, input_len_max=90, output_len=4, output_len_max=30,
                                                 seed=7, timeout_s=300))


def prefix_cache_counters(server) -> tuple[float, float]:
    """vLLM's own prefix-cache counters (queried, hit prompt tokens) from its Prometheus endpoint."""
    status, body = get(server.url + "/metrics")
    assert status == 200
    text = body.decode()

    def total(name):
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} ([\d.e+]+)$", text, re.MULTILINE))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def test_vllm_prefix_caching_drives_the_engine_cache(setup):
    """vLLM's block manager owns the KV cache: a prompt sharing its first blocks with an earlier one is a
    prefix-cache hit in vLLM's metrics, and its tokens still equal neuron-infer's own (the hit's blocks hold the
    earlier request's K/V)."""
    server, ours = setup
    bs = ours.engine.block_size
    first = list(range(11, 11 + 3 * bs + 5))
    second = first[: 3 * bs] + [4, 8, 15, 16]
    queries, hits = prefix_cache_counters(server)
    for prompt in (first, second):
        got = complete(server, prompt=prompt, max_tokens=8, ignore_eos=True, return_token_ids=True)
        assert got["token_ids"] == ours.generate_ids([prompt], 8, ignore_eos=True).outputs[0].token_ids
    queries2, hits2 = prefix_cache_counters(server)
    assert queries2 - queries >= len(first) + len(second) and hits2 - hits >= 3 * bs


def test_clean_shutdown(setup):
    server, _ = setup
    rc, seconds, leftover = server.terminate(grace_s=60)
    assert rc is not None, f"API server still running {seconds:.0f} s after SIGTERM"
    assert not leftover, "engine core / worker processes outlived the API server"
    log = server.log.read_text()  # the cache vLLM was told about: the engine's blocks, vLLM's block manager
    assert re.search(r"neuron-infer: KV cache of \d+ blocks of \d+ tokens \([\d.]+ GiB per rank\), managed by vLLM's "
                     r"block manager", log), log[-3000:]
