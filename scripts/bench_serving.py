#!/usr/bin/env python3
"""Load generator for any OpenAI-compatible server: TTFT, inter-token latency, end-to-end latency, throughput.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 50 --concurrency 4 \
        --input-len 128 --output-len 64 [--endpoint completions|chat] [--no-stream] [--json results.json]
    python scripts/bench_serving.py --compare stock=http://127.0.0.1:8001 --compare plugin=http://127.0.0.1:8002 \
        --rounds 3 -n 16 -c 4      # alternating rounds (order reversed every round), medians per server

The measurements of docs/case-studies.md CS3 (LLMPerf-style): per request
  TTFT  time from sending the request to the first streamed content chunk,
  ITL   gaps between successive content chunks (one value per gap, pooled over all requests),
  ITL/token  the same gaps per token: a chunk carrying n tokens (speculative decoding emits several per step)
        counts as n gaps of gap/n (token counts from vLLM's `return_token_ids`; 1 per chunk when absent), so it
        is comparable with and without speculation (LLMPerf's inter-token latency is per token as well),
  TPOT  (e2e - TTFT) / (output tokens - 1), the per-request mean time per output token,
  E2E   time from sending the request to the end of the response;
and for the run: p50/p90/p99 of each, output tokens/s (all output tokens / wall time), requests/s and the error
count (HTTP status != 200, connection errors, timeouts, malformed streams).

Prompts are exact-length lists of token ids (the completions API accepts them, so input lengths do not depend on a
tokenizer); `--prompt-style text` sends words instead (needed for /v1/chat/completions). `--ignore-eos` (default on)
asks vLLM to produce exactly `--output-len` tokens. Only the standard library is used (threads + http.client), so
the script runs in any environment.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # "completions" | "chat"
    num_requests: int = 32
    concurrency: int = 4
    input_len: int = 128
    output_len: int = 64
    input_len_max: int | None = None  # when set, input lengths are uniform in [input_len, input_len_max]
    output_len_max: int | None = None  # when set, output lengths are uniform in [output_len, output_len_max]
    stream: bool = True
    prompt_style: str = "ids"  # "ids" (token id lists) | "text"
    token_range: tuple[int, int] = (10, 300)  # ids are drawn from [lo, hi)
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint={self.endpoint!r}: choose completions or chat")
        if self.prompt_style not in ("ids", "text"):
            raise ValueError(f"prompt_style={self.prompt_style!r}: choose ids or text")
        if self.endpoint == "chat" and self.prompt_style == "ids":
            raise ValueError("the chat endpoint takes text messages: pass --prompt-style text")
        if self.num_requests < 1 or self.concurrency < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, concurrency, input_len and output_len must be >= 1")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: list[int] | str
    max_tokens: int


@dataclass
class RequestRecord:
    """What one request saw. Times are time.perf_counter() seconds; chunk_times has one entry per content chunk."""

    index: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each content chunk
    output_tokens: int = 0
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start


# ---------------------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    out["n"] = len(values)
    return out


def summarize(records: list[RequestRecord]) -> dict:
    """Run-level statistics. Failed requests count as errors and are left out of every latency distribution."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    itl_tok = [(b - a) / n for r in ok for a, b, n in zip(r.chunk_times, r.chunk_times[1:], _later_counts(r))
               for _ in range(n)]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    wall = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall if wall > 0 else math.nan,
        "requests_per_s": len(ok) / wall if wall > 0 else math.nan,
        "ttft_s": distribution(ttft),
        "itl_s": distribution(itl),
        "itl_token_s": distribution(itl_tok),
        "tpot_s": distribution(tpot),
        "e2e_s": distribution([r.e2e for r in ok]),
    }


def _later_counts(r: RequestRecord) -> list[int]:
    """Tokens of chunks 2..n (1 each when the server did not report token ids)."""
    counts = r.chunk_tokens if len(r.chunk_tokens) == len(r.chunk_times) else [1] * len(r.chunk_times)
    return [max(int(n), 1) for n in counts[1:]]


# ---------------------------------------------------------------------------------------------------- workload


def make_requests(cfg: BenchConfig) -> list[RequestSpec]:
    """Deterministic prompts (seeded): exact-length token-id lists, or `n` words for the text style."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.token_range
    out = []
    for i in range(cfg.num_requests):
        n_in = rng.randint(cfg.input_len, cfg.input_len_max) if cfg.input_len_max else cfg.input_len
        n_out = rng.randint(cfg.output_len, cfg.output_len_max) if cfg.output_len_max else cfg.output_len
        ids = [rng.randrange(lo, hi) for _ in range(n_in)]
        prompt: list[int] | str = ids if cfg.prompt_style == "ids" else " ".join(f"w{t}" for t in ids)
        out.append(RequestSpec(i, prompt, n_out))
    return out


def request_body(cfg: BenchConfig, model: str, spec: RequestSpec) -> dict:
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "temperature": cfg.temperature,
                  "stream": cfg.stream, "seed": cfg.seed + spec.index}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: exactly max_tokens tokens
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
        body["return_token_ids"] = True  # vLLM extension (ignored by servers that do not know it)
    return body


# ---------------------------------------------------------------------------------------------------- HTTP client


class Client:
    """Minimal blocking OpenAI-API client over http.client (one connection per request: no shared state)."""

    def __init__(self, base_url: str, timeout_s: float):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"base_url={base_url!r}: give http://HOST:PORT (https is not supported)")
        self.host, self.port, self.prefix, self.timeout = u.hostname, u.port or 80, u.path.rstrip("/"), timeout_s

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", self.prefix + path)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {data[:200]!r}")
            return json.loads(data)
        finally:
            conn.close()

    def post(self, path: str, body: dict, rec: RequestRecord, stream: bool) -> None:
        """Send one request and fill `rec` (times, text, token counts); errors land in rec.error."""
        conn = self._conn()
        rec.start = time.perf_counter()
        try:
            conn.request("POST", self.prefix + path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            elif stream:
                _read_stream(resp, rec)
            else:
                _read_whole(json.loads(resp.read()), rec)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            rec.end = time.perf_counter()
            conn.close()


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _add_choice(choice: dict, rec: RequestRecord) -> int:
    """Append one choice's text/token ids; return how many tokens it carried (ids when given, else 1 per chunk)."""
    rec.text += _choice_text(choice)
    ids = choice.get("token_ids")
    if ids is not None:
        rec.token_ids = (rec.token_ids or []) + list(ids)
    if choice.get("finish_reason"):
        rec.finish_reason = choice["finish_reason"]
    return len(ids) if ids is not None else (1 if _choice_text(choice) else 0)


def _read_stream(resp, rec: RequestRecord) -> None:
    counted, usage = 0, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            rec.error = f"stream error: {json.dumps(event['error'])[:300]}"
            return
        now = time.perf_counter()
        for choice in event.get("choices") or []:
            n = _add_choice(choice, rec)
            if not n and not counted and choice.get("finish_reason"):
                n = 1  # the only token's text was held back (part of a UTF-8 character): it arrived here
            if n:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(n)
                counted += n
        usage = event.get("usage") or usage
    rec.output_tokens = int(usage["completion_tokens"]) if usage else counted
    if rec.finish_reason is None:
        rec.error = "stream ended without a finish_reason"


def _read_whole(data: dict, rec: RequestRecord) -> None:
    counted = sum(_add_choice(c, rec) for c in data.get("choices") or [])
    usage = data.get("usage")
    rec.output_tokens = int(usage["completion_tokens"]) if usage else counted
    rec.chunk_times.append(time.perf_counter())  # non-streaming: the "first token" arrives with the last


# ---------------------------------------------------------------------------------------------------- driver


def run_benchmark(cfg: BenchConfig, specs: list[RequestSpec] | None = None) -> tuple[dict, list[RequestRecord]]:
    """Send the requests with at most `concurrency` in flight; return (summary, per-request records)."""
    client = Client(cfg.base_url, cfg.timeout_s)
    model = cfg.model or client.get_json("/v1/models")["data"][0]["id"]
    specs = specs if specs is not None else make_requests(cfg)
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    records = [RequestRecord(s.index) for s in specs]
    lock = threading.Lock()
    pending = iter(zip(specs, records))

    def worker() -> None:
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            spec, rec = item
            client.post(path, request_body(cfg, model, spec), rec, cfg.stream)

    with ThreadPoolExecutor(max_workers=min(cfg.concurrency, len(specs))) as pool:
        for f in [pool.submit(worker) for _ in range(min(cfg.concurrency, len(specs)))]:
            f.result()
    summary = summarize(records)
    summary["config"] = {**asdict(cfg), "model": model}
    return summary, records


def format_table(summary: dict) -> str:
    """A Markdown table of the run (milliseconds for latencies)."""
    rows = ["| metric | p50 | p90 | p99 | mean |", "|---|---|---|---|---|"]
    for key, name in (("ttft_s", "TTFT (ms)"), ("itl_s", "ITL per chunk (ms)"), ("itl_token_s", "ITL per token (ms)"),
                      ("tpot_s", "TPOT (ms)"), ("e2e_s", "E2E (ms)")):
        d = summary[key]
        rows.append(f"| {name} | " + " | ".join(f"{1000 * d[k]:.1f}" for k in ("p50", "p90", "p99", "mean")) + " |")
    rows.append(f"\nrequests {summary['completed']}/{summary['requests']} ok, errors {summary['errors']}, "
                f"output {summary['output_tokens']} tokens in {summary['wall_s']:.2f} s = "
                f"{summary['output_tok_per_s']:.1f} tok/s, {summary['requests_per_s']:.2f} req/s")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------- comparison

COMPARE_METRICS = (("itl_s", "p50"), ("itl_s", "p90"), ("ttft_s", "p50"), ("ttft_s", "p90"))


def compare(cfg: BenchConfig, servers: dict[str, str], rounds: int, run=None) -> dict[str, list[dict]]:
    """The same workload against every server, `rounds` times, the order reversed every round (a, b | b, a | ...)
    so drifting background load hits both sides alike; each summary records the 1-minute load average before it."""
    run = run or run_benchmark
    names = list(servers)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
            summary, _ = run(replace(cfg, base_url=servers[name]))
            summary["load1"] = load
            out[name].append(summary)
    return out


def median_of_runs(runs: list[dict]) -> dict:
    """Per-run values and their median: ITL / TTFT p50 and p90 (s), output tok/s, load; errors summed."""
    def med(xs: list[float]) -> float:
        return percentile(xs, 50)

    out = {f"{k}_{q}": med([r[k][q] for r in runs]) for k, q in COMPARE_METRICS}
    out["output_tok_per_s"] = med([r["output_tok_per_s"] for r in runs])
    out["load1"] = med([r.get("load1", math.nan) for r in runs])
    out["errors"] = sum(r["errors"] for r in runs)
    out["rounds"] = len(runs)
    return out


def format_compare(results: dict[str, list[dict]]) -> str:
    """A Markdown table: one row per server, medians over its rounds (milliseconds for latencies)."""
    head = ("| server | rounds | ITL p50 (ms) | ITL p90 (ms) | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | errors "
            "| load (1 min) |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        m = median_of_runs(runs)
        lat = " | ".join(f"{1000 * m[f'{k}_{q}']:.1f}" for k, q in COMPARE_METRICS)
        rows.append(f"| {name} | {m['rounds']} | {lat} | {m['output_tok_per_s']:.1f} | {m['errors']} | "
                    f"{m['load1']:.1f} |")
    return "\n".join(rows)


def parse_servers(items: list[str]) -> dict[str, str]:
    """["name=http://host:port", ...] -> {name: url} (names unique)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--compare {item!r}: give NAME=URL, e.g. stock=http://127.0.0.1:8001")
        if name in out:
            raise ValueError(f"--compare names must be unique; {name!r} is given twice")
        out[name] = url
    return out


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-requests", "-n", type=int, default=32)
    p.add_argument("--concurrency", "-c", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=None, help="mixed lengths: uniform in [input-len, this]")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-len-max", type=int, default=None, help="mixed lengths: uniform in [output-len, this]")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--prompt-style", choices=("ids", "text"), default="ids")
    p.add_argument("--token-range", type=int, nargs=2, default=(10, 300), metavar=("LO", "HI"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--respect-eos", dest="ignore_eos", action="store_false", help="stop at EOS (default: ignore)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", dest="json_out", default=None, help="write the summary (and per-request records) here")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=URL",
                   help="repeat for each server: alternating rounds against all of them (--base-url is ignored)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per server with --compare")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    cfg = BenchConfig(a.base_url, a.model, a.endpoint, a.num_requests, a.concurrency, a.input_len, a.output_len,
                      a.input_len_max, a.output_len_max, a.stream, a.prompt_style, tuple(a.token_range),
                      a.temperature, a.ignore_eos, a.seed, a.timeout)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.compare:
        try:
            servers = parse_servers(args.compare)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        results = compare(cfg, servers, args.rounds)
        print(format_compare(results))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"rounds": results, "median": {n: median_of_runs(r) for n, r in results.items()}}, f,
                          indent=1)
        return 1 if any(r["errors"] for runs in results.values() for r in runs) else 0
    summary, records = run_benchmark(cfg)
    print(format_table(summary))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "records": [asdict(r) for r in records]}, f, indent=1)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
