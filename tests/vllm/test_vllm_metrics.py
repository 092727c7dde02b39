"""vLLM's scheduler gauges on `/metrics` while prompts are encoded: `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.

vLLM publishes them once per step, when the step returns. Four streamed requests with 500-token prompts arrive at a
plugin server (step budget: the runtime's prefill chunk, 256 tokens, platform.py) and /metrics is polled until they
finish. While some request still waits for its first token, a poll already counts all four requests as running or
waiting, with KV-cache blocks in use; once every prompt is encoded the blocks in use are each request's
ceil(512 / 32) blocks, as stock vLLM CPU (plugin off) reports for the same requests (slow test).

The model is larger than the other tests' tiny one (8 layers of width 512, eager fp32) so that encoding 256 prompt
tokens takes long enough for several polls.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from tests.vllm.vllm_helpers import Server, get, require_vllm

require_vllm()

from neuron_infer.api import compile_model
from neuron_infer.config import BuildConfig
from tests.tiny_checkpoint import write_tiny_checkpoint

SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024}
REQUESTS, PROMPT, OUT, BS = 4, 500, 12, 32  # stock vLLM CPU attention takes blocks of 32k
BLOCKS_EACH = -(-(PROMPT + OUT) // BS)  # vLLM's blocks for one request's prompt and output tokens
SERVE = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", str(REQUESTS), "--enforce-eager",
         "--served-model-name", "m", "--block-size", str(BS)]
POLL_S = 0.02


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    ckpt = write_tiny_checkpoint(root / "m", **SHAPE)
    art = root / "art"
    build = BuildConfig(dtype="fp32", batch_size=REQUESTS, max_context_length=512, max_length=1024,
                        kv_block_size=BS)
    compile_model(ckpt, art, build, backend="cpu-eager", say=lambda m: None)
    return root, ckpt, art


def gauges(text: str) -> dict[str, float]:
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        m = re.search(rf"^vllm:{name}{{[^}}]*}} ([\d.e+-]+)$", text, re.MULTILINE)
        assert m, f"vllm:{name} missing from /metrics"
        out[name] = float(m.group(1))
    return out


def usable_blocks(text: str) -> int:
    """vLLM's KV-cache blocks besides its null block (kv_cache_usage_perc is a fraction of these)."""
    m = re.search(r'^vllm:cache_config_info{[^}]*num_gpu_blocks="(\d+)"', text, re.MULTILINE)
    assert m, "vllm:cache_config_info has no num_gpu_blocks"
    return int(m.group(1)) - 1


def timeline(server: Server) -> tuple[list[tuple[float, float, float, int]], list[float]]:
    """Stream REQUESTS requests at once and poll /metrics until they end -> polls (time, running, waiting, KV blocks
    in use) and each request's first-token time (same clock)."""
    blocks = usable_blocks(get(server.url + "/metrics")[1].decode())
    first: dict[int, float] = {}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        body = {"model": "m", "prompt": [7 + (i * 13 + j) % 200 for j in range(PROMPT)], "max_tokens": OUT,
                "stream": True, "ignore_eos": True, "temperature": 0.0}
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                for line in resp:
                    if line.startswith(b"data: {") and i not in first:
                        first[i] = time.monotonic()
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
    polls = []
    while any(t.is_alive() for t in threads):
        g = gauges(get(server.url + "/metrics")[1].decode())
        polls.append((time.monotonic(), g["num_requests_running"], g["num_requests_waiting"],
                      round(g["kv_cache_usage_perc"] * blocks)))
        time.sleep(POLL_S)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(first) == REQUESTS
    return polls, sorted(first.values())


def served(model, plugin: bool) -> tuple[list[tuple[float, float, float, int]], list[float], str]:
    root, ckpt, art = model
    args = [*SERVE, "--additional-config", json.dumps({"neuron_infer_artifacts": str(art)})] if plugin else SERVE
    server = Server(ckpt, args, root / ("plugin.log" if plugin else "stock.log"),
                    **({} if plugin else {"NEURON_INFER_VLLM": "0"}))
    try:
        server.wait_ready()
        polls, first = timeline(server)
    finally:
        server.kill()
    return polls, first, server.log.read_text()


@pytest.fixture(scope="module")
def plugin(model):
    return served(model, plugin=True)


def test_admitted_requests_are_reported_while_prompts_encode(plugin):
    polls, first, log = plugin
    assert "neuron-infer: step budget 256 prompt tokens" in log
    encoding = [p for p in polls if p[0] < first[-1]]  # some request has no token yet
    admitted = [(run, wait, kv) for _, run, wait, kv in encoding if run >= 1 and run + wait == REQUESTS and kv > 0]
    assert admitted, f"no poll before the last first token counted all {REQUESTS} requests: {encoding}"
    for _, run, wait, kv in polls:
        assert run + wait <= REQUESTS and 0 <= kv <= REQUESTS * BLOCKS_EACH
        assert kv == 0 or run >= 1  # blocks in use belong to running requests
    # every prompt encoded, no request finished yet: each holds its prompt's and output's blocks
    assert max(kv for *_, kv in polls) == REQUESTS * BLOCKS_EACH
    assert max(run for _, run, _, _ in polls) == REQUESTS


@pytest.mark.slow
def test_kv_blocks_and_counts_equal_stock_vllm(plugin, model):
    """Stock vLLM CPU on the same requests holds the same blocks at its peak and runs the same requests (its
    default step budget encodes the prompts that arrived together in one step and reports them when it returns)."""
    stock_polls, _, _ = served(model, plugin=False)
    ours = plugin[0]
    assert max(kv for *_, kv in stock_polls) == max(kv for *_, kv in ours) == REQUESTS * BLOCKS_EACH
    assert max(run for _, run, _, _ in stock_polls) == max(run for _, run, _, _ in ours) == REQUESTS
