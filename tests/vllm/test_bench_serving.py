"""scripts/bench_serving.py: statistics on hand-made records, and a run against a fake streaming server.

The fake server is stdlib http on 127.0.0.1 speaking just enough of the OpenAI completions API (SSE chunks with
one token each, a usage chunk, [DONE]); it fails every request whose prompt starts with token 666, so the error
count is known in advance. No vLLM needed: this module runs in the main test environment.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_serving", Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py")
bench = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_serving"] = bench  # dataclasses resolve annotations through sys.modules
_SPEC.loader.exec_module(bench)

FAIL_TOKEN = 666
HELD_BACK_TOKEN = 667  # the fake server streams one token whose text the detokenizer holds back (empty, no ids)


def assert_loaded_equals_alone(cfg) -> None:
    """Run workload `cfg` against a live server, then again one request at a time: no errors, every request gets
    its max_tokens, and each output under load equals the same request alone (greedy serving tests)."""
    summary, loaded = bench.run_benchmark(cfg)
    assert summary["errors"] == 0 and summary["completed"] == cfg.num_requests
    _, alone = bench.run_benchmark(bench.BenchConfig(**{**cfg.__dict__, "concurrency": 1}))
    for spec, a, b in zip(bench.make_requests(cfg), loaded, alone):
        assert a.output_tokens == spec.max_tokens
        assert a.token_ids == b.token_ids, f"request {spec.index} differs under load"


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.percentile(xs, 50) == 3.0
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 5.0
    assert bench.percentile(xs, 90) == pytest.approx(4.6)  # rank 0.9 * 4 = 3.6 -> 4 + 0.6 * (5 - 4)
    assert bench.percentile([7.0], 99) == 7.0
    assert math.isnan(bench.percentile([], 50))
    ref = list(range(101))  # p-th percentile of 0..100 is p
    assert [bench.percentile(ref, q) for q in (50, 90, 99)] == [50, 90, 99]


def test_summarize_on_known_records():
    r1 = bench.RequestRecord(0, start=10.0, end=10.5, chunk_times=[10.1, 10.2, 10.4], output_tokens=3)
    r2 = bench.RequestRecord(1, start=10.2, end=11.0, chunk_times=[10.5, 11.0], output_tokens=2)
    bad = bench.RequestRecord(2, start=10.3, end=10.35, error="HTTP 500: boom")
    s = bench.summarize([r1, r2, bad])
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["error_messages"] == ["HTTP 500: boom"]
    assert s["wall_s"] == pytest.approx(1.0)  # 10.0 .. 11.0
    assert s["output_tokens"] == 5 and s["output_tok_per_s"] == pytest.approx(5.0)
    assert s["ttft_s"]["n"] == 2 and s["ttft_s"]["p50"] == pytest.approx(0.2)  # 0.1 and 0.3
    assert s["itl_s"]["n"] == 3 and s["itl_s"]["p50"] == pytest.approx(0.2)  # gaps 0.1, 0.2 | 0.5
    assert s["tpot_s"]["mean"] == pytest.approx(((0.5 - 0.1) / 2 + (0.8 - 0.3) / 1) / 2)
    assert s["e2e_s"]["p50"] == pytest.approx(0.65)  # 0.5 and 0.8
    assert s["itl_token_s"]["n"] == 3  # no token counts recorded: one token per chunk, same gaps as ITL


def test_itl_per_token_splits_multi_token_chunks():
    # speculative decoding: the 2nd chunk carries 3 tokens after a 0.3 s gap -> three per-token gaps of 0.1 s
    r = bench.RequestRecord(0, start=0.0, end=0.6, chunk_times=[0.1, 0.4, 0.6], chunk_tokens=[1, 3, 1],
                            output_tokens=5)
    s = bench.summarize([r])
    assert s["itl_s"]["n"] == 2 and s["itl_s"]["mean"] == pytest.approx(0.25)  # per chunk: 0.3, 0.2
    assert s["itl_token_s"]["n"] == 4  # = output tokens - 1
    d = s["itl_token_s"]  # values 0.1, 0.1, 0.1, 0.2
    assert (d["p50"], d["p90"], d["mean"]) == pytest.approx((0.1, 0.17, 0.125))


class _FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self._send_json(200, {"data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt[0] == FAIL_TOKEN:
            return self._send_json(500, {"error": "injected failure"})
        tokens = [(len(prompt) + i) % 50 for i in range(n)]  # deterministic "generation"
        if not body["stream"]:
            return self._send_json(200, {"choices": [{"text": "".join(f"t{t} " for t in tokens),
                                                      "token_ids": tokens, "finish_reason": "length"}],
                                         "usage": {"completion_tokens": n}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if prompt[0] == HELD_BACK_TOKEN:
            tokens = tokens[:1]
            self._chunk({"choices": [{"text": "", "finish_reason": "length"}]})
        for i, t in enumerate(tokens if prompt[0] != HELD_BACK_TOKEN else []):
            fin = "length" if i == n - 1 else None
            self._chunk({"choices": [{"text": f"t{t} ", "token_ids": [t], "finish_reason": fin}]})
        self._chunk({"choices": [], "usage": {"completion_tokens": n}})
        self._write(b"data: [DONE]\n\n")
        self._write(b"")  # terminating chunk

    def _chunk(self, obj):
        self._write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _write(self, data: bytes):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("stream", [True, False])
def test_run_against_fake_server_counts_tokens_and_errors(fake_server, stream):
    cfg = bench.BenchConfig(base_url=fake_server, num_requests=12, concurrency=3, input_len=4, input_len_max=9,
                            output_len=2, output_len_max=6, stream=stream, seed=3, timeout_s=30)
    specs = bench.make_requests(cfg)
    specs[5] = bench.RequestSpec(5, [FAIL_TOKEN] + specs[5].prompt[1:], specs[5].max_tokens)  # one known failure
    summary, records = bench.run_benchmark(cfg, specs)
    assert summary["config"]["model"] == "fake-model"
    assert (summary["completed"], summary["errors"]) == (11, 1)
    assert records[5].error.startswith("HTTP 500")
    for spec, rec in zip(specs, records):
        if rec.index == 5:
            continue
        expect = [(len(spec.prompt) + i) % 50 for i in range(spec.max_tokens)]
        assert rec.token_ids == expect and rec.output_tokens == spec.max_tokens
        assert rec.text == "".join(f"t{t} " for t in expect) and rec.finish_reason == "length"
        assert rec.start <= rec.chunk_times[0] <= rec.chunk_times[-1] <= rec.end
        assert len(rec.chunk_times) == (spec.max_tokens if stream else 1)
    assert summary["output_tokens"] == sum(s.max_tokens for s in specs) - specs[5].max_tokens
    ok = [r for r in records if r.error is None]
    assert summary["itl_s"]["n"] == sum(len(r.chunk_times) - 1 for r in ok)
    assert summary["ttft_s"]["n"] == 11 and summary["e2e_s"]["n"] == 11
    assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p99"]


def test_a_single_token_with_held_back_text_still_counts_as_the_first_token(fake_server):
    """vLLM streams an empty text for a token that ends inside a UTF-8 character; a one-token completion then has
    only its final chunk, which must still give a time to first token (bench_prefix_cache.py times those)."""
    client = bench.Client(fake_server, 30.0)
    rec = bench.RequestRecord(0)
    client.post("/v1/completions", {"model": "fake-model", "prompt": [HELD_BACK_TOKEN, 1, 2], "max_tokens": 1,
                                    "temperature": 0.0, "stream": True}, rec, stream=True)
    assert rec.error is None and rec.finish_reason == "length" and rec.text == ""
    assert rec.ttft is not None and rec.chunk_tokens == [1] and rec.output_tokens == 1


def test_workload_is_deterministic_and_within_bounds():
    cfg = bench.BenchConfig(num_requests=20, input_len=3, input_len_max=8, output_len=5, output_len_max=7, seed=1)
    a, b = bench.make_requests(cfg), bench.make_requests(cfg)
    assert a == b
    assert all(3 <= len(s.prompt) <= 8 and 5 <= s.max_tokens <= 7 for s in a)
    assert len({len(s.prompt) for s in a}) > 1  # mixed lengths really are mixed
    assert all(10 <= t < 300 for s in a for t in s.prompt)
    with pytest.raises(ValueError, match="prompt-style text"):
        bench.BenchConfig(endpoint="chat")


def test_cli_writes_json(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--base-url", fake_server, "-n", "4", "-c", "2", "--input-len", "3", "--output-len", "3",
                     "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 4 and len(data["records"]) == 4
    assert "| TTFT (ms) |" in capsys.readouterr().out


def test_compare_alternates_order_and_takes_medians(fake_server):
    calls = []

    def run(cfg):  # records which server each run hit; the ITL it reports tells the runs apart
        calls.append(cfg.base_url)
        summary, _ = bench.run_benchmark(cfg)
        summary["itl_s"]["p50"] = float(len(calls))
        return summary, _

    cfg = bench.BenchConfig(num_requests=2, concurrency=1, input_len=3, output_len=2, timeout_s=30)
    servers = {"a": fake_server + "/", "b": fake_server}  # two URLs of one fake server
    results = bench.compare(cfg, servers, rounds=3, run=run)
    assert calls == [servers["a"], servers["b"], servers["b"], servers["a"], servers["a"], servers["b"]]
    assert [r["itl_s"]["p50"] for r in results["a"]] == [1.0, 4.0, 5.0]
    assert [r["itl_s"]["p50"] for r in results["b"]] == [2.0, 3.0, 6.0]
    med = bench.median_of_runs(results["a"])
    assert med["itl_s_p50"] == 4.0 and med["rounds"] == 3 and med["errors"] == 0
    assert med["output_tok_per_s"] > 0
    table = bench.format_compare(results)
    assert "| a | 3 | 4000.0 |" in table and "| b | 3 | 3000.0 |" in table


def test_compare_cli_rejects_bad_server_spec(capsys):
    assert bench.main(["--compare", "no-url-here"]) == 2
    assert capsys.readouterr().err.startswith("error: --compare 'no-url-here': give NAME=URL")
    assert bench.main(["--compare", "a=http://x:1", "--compare", "a=http://y:2"]) == 2


def test_prefix_cache_benchmark_times_the_first_token_of_a_server(fake_server):
    """bench_prefix_cache.py's server mode sends the load generator's request body (greedy, streamed, token ids) and
    gets a first-token time, also when that token's text is held back."""
    spec = importlib.util.spec_from_file_location(
        "bench_prefix_cache", Path(__file__).resolve().parents[2] / "scripts" / "bench_prefix_cache.py")
    prefix_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefix_cache)
    first_token = prefix_cache.server_ttft(fake_server)
    assert 0 < first_token([5, 6, 7]) < 30 and 0 < first_token([HELD_BACK_TOKEN, 1]) < 30
