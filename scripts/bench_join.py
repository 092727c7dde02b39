#!/usr/bin/env python3
"""A long prompt joins running requests: how much does it stall them? (chunked prefill vs whole prompts)

    python scripts/bench_join.py --server chunked=http://127.0.0.1:8001 --server whole=http://127.0.0.1:8002 \
        --rounds 3 --running 3 --running-output 160 --join-input 2000

Per round and server (servers alternate, the order reversed every round): `--running` streaming requests start
(`--running-input` token prompts, `--running-output` tokens each); once each has streamed `--join-after` tokens, one
request with a `--join-input` token prompt is sent. Every prompt is fresh random token ids (a prefix cache finds
nothing). Reported per server (medians over rounds):
  ITL p50 / p90 / p99 / max  the running requests' gaps between streamed tokens, pooled over the whole run,
  stall                      their longest gap while the long prompt was being encoded (from sending it to its
                             first token),
  join TTFT                  the long request's time to first token.
Only the standard library is used, with scripts/bench_serving.py's client and statistics.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("bench_serving", Path(__file__).with_name("bench_serving.py"))
serving = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_serving"] = serving  # its dataclasses look their module up
_SPEC.loader.exec_module(serving)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


def _post(client, model: str, prompt: list[int], max_tokens: int, rec) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    client.post("/v1/completions", body, rec, stream=True)


def one_round(url: str, args: argparse.Namespace, seed: int) -> dict:
    """Run one join scenario against `url` -> its numbers."""
    client = serving.Client(url, args.timeout)
    model = client.get_json("/v1/models")["data"][0]["id"]
    rng = random.Random(seed)
    recs = [serving.RequestRecord(i) for i in range(args.running)]
    threads = [threading.Thread(target=_post, args=(client, model, _prompt(rng, args.running_input),
                                                    args.running_output, r)) for r in recs]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + args.timeout
    while any(len(r.chunk_times) < args.join_after and r.error is None for r in recs):
        if time.perf_counter() > deadline:
            raise RuntimeError("the running requests did not start in time")
        time.sleep(0.005)
    join = serving.RequestRecord(args.running)
    _post(client, model, _prompt(rng, args.join_input), args.join_output, join)
    for t in threads:
        t.join()
    errors = [r.error for r in [*recs, join] if r.error]
    if errors:
        raise RuntimeError(f"{url}: {errors[0]}")
    spans = [(a, b) for r in recs for a, b in zip(r.chunk_times, r.chunk_times[1:])]  # (start, end) of each gap
    first = join.chunk_times[0]
    during = [b - a for a, b in spans if b > join.start and a < first]  # overlapping the long prompt's prefill
    itl = [b - a for a, b in spans]
    return {"itl_p50_ms": 1e3 * serving.percentile(itl, 50), "itl_p90_ms": 1e3 * serving.percentile(itl, 90),
            "itl_p99_ms": 1e3 * serving.percentile(itl, 99), "itl_max_ms": 1e3 * max(itl),
            "stall_ms": 1e3 * max(during, default=0.0), "join_ttft_s": join.ttft,
            "gaps_during_join": len(during), "gaps": len(itl)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="NAME=URL (repeat to compare servers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, default=3)
    ap.add_argument("--running-input", type=int, default=128)
    ap.add_argument("--running-output", type=int, default=160)
    ap.add_argument("--join-after", type=int, default=16)
    ap.add_argument("--join-input", type=int, default=2000)
    ap.add_argument("--join-output", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    servers = serving.parse_servers(args.server)
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for rnd in range(args.rounds):
        order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
        for name in order:
            got = one_round(servers[name], args, seed=1000 * rnd + list(servers).index(name))
            runs[name].append(got)
            print(f"round {rnd + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    print(f"\n{args.running} running requests ({args.running_input}-token prompts, {args.running_output} tokens), "
          f"one {args.join_input}-token prompt joining; medians of {args.rounds} rounds")
    print(f"{'server':>12} | ITL p50 ms | p90 ms | p99 ms | max ms | p90/p50 | stall ms | join TTFT s")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name:>12} | {med['itl_p50_ms']:10.1f} | {med['itl_p90_ms']:6.1f} | {med['itl_p99_ms']:6.1f} | "
              f"{med['itl_max_ms']:6.0f} | {med['itl_p90_ms'] / med['itl_p50_ms']:7.2f} | {med['stall_ms']:8.0f} | "
              f"{med['join_ttft_s']:11.2f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
