#!/usr/bin/env python3
"""A long prompt joins running sequences: how much does it stall them? Chunked prefill vs whole prompts.

    python scripts/bench_join.py ARTIFACT --chunks 0,256 --rounds 3 --running 3 --running-input 128 \
        --running-output 160 --join-input 2000
    python scripts/bench_join.py --server chunked=http://127.0.0.1:8101 --server whole=http://127.0.0.1:8102 \
        --rounds 3 --join-input 2000      # through OpenAI-compatible servers (vLLM): streamed completions

In-process, on neuron-infer's runtime (the loop of `generate`: one Runner step over the decoding sequences, then the
prefill of new and still-encoding prompts), per chunk size; or through each `--server` (its own settings decide how
prompts are chunked, e.g. vLLM's --max-num-batched-tokens). Per round and chunk size or server (alternating, the
order reversed every round): `--running` sequences start (`--running-input` token prompts, `--running-output`
tokens each, greedy, ignore_eos); once each has `--join-after` tokens, one sequence with a `--join-input` token
prompt joins. Prompts are fresh random token ids (ids 1000-9999 for servers), so no prefix is cached; in-process
prefix caching is off too. Reported per chunk size or server (medians over rounds; 0 = whole prompts):
  ITL p50 / p90 / max  the running sequences' gaps between tokens (servers: between streamed chunks) over the run,
  stall                their longest gap while the long prompt was being encoded,
  join TTFT            the long prompt's time to its first token.
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from neuron_infer.api import CompiledModel
from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import make_generator
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.runner import Runner
from neuron_infer.runtime.sequence import Sequence, StopRule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the serving benchmark's statistics
from bench_serving import Client, RequestRecord, percentile


def one_round(model: CompiledModel, chunk: int, args: argparse.Namespace, rng: random.Random) -> dict:
    runner = Runner(model.engine, options=RunOptions(prefix_caching=False, prefill_chunk=chunk))
    sched = runner.scheduler

    def seq(i: int, n_prompt: int, n_new: int) -> Sequence:
        prompt = [rng.randrange(100, model.manifest.model.vocab_size) for _ in range(n_prompt)]
        return Sequence(i, prompt, SamplingConfig(), StopRule(max_new_tokens=n_new), make_generator(None))

    running = [seq(i, args.running_input, args.running_output) for i in range(args.running)]
    join = seq(args.running, args.join_input, args.join_output)
    for s in running:
        sched.add(s)
    times: dict[Sequence, list[float]] = {s: [] for s in [*running, join]}
    joined_at = None
    while sched.has_work:
        if joined_at is None and all(len(s.output) >= args.join_after for s in running):
            sched.add(join)
            joined_at = time.perf_counter()
        decoding = runner.decoding()
        runner.step(decoding, decoding)
        runner.prefill(sched.admit())
        sched.release_finished()
        now = time.perf_counter()
        for s, ts in times.items():
            ts.extend([now] * (len(s.output) - len(ts)))  # one step: one token per decoding sequence
    return join_stats([times[s] for s in running], joined_at, times[join][0])


def join_stats(running: list[list[float]], joined_at: float, first: float) -> dict:
    """The statistics of one round from the running sequences' token times, the join time and the joining
    prompt's first-token time (all perf_counter seconds)."""
    spans = [(a, b) for ts in running for a, b in itertools.pairwise(ts)]
    itl = [b - a for a, b in spans]
    during = [b - a for a, b in spans if b > joined_at and a < first]
    return {"itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p90_ms": 1e3 * percentile(itl, 90),
            "itl_max_ms": 1e3 * max(itl), "stall_ms": 1e3 * max(during, default=0.0),
            "join_ttft_s": first - joined_at}


def server_round(url: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """One round through the server at `url`: streamed greedy completions of random token-id prompts."""
    client = Client(url, 1800.0)
    name = client.get_json("/v1/models")["data"][0]["id"]

    def start(n_prompt: int, n_out: int) -> tuple[RequestRecord, threading.Thread]:
        body = {"model": name, "prompt": [rng.randrange(1000, 10000) for _ in range(n_prompt)], "max_tokens": n_out,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        rec = RequestRecord(0)
        thread = threading.Thread(target=client.post, args=("/v1/completions", body, rec, True), daemon=True)
        thread.start()
        return rec, thread

    running = [start(args.running_input, args.running_output) for _ in range(args.running)]
    while any(len(r.chunk_times) < args.join_after and t.is_alive() for r, t in running):
        time.sleep(0.002)
    joined_at = time.perf_counter()
    join = start(args.join_input, args.join_output)
    for _, t in [*running, join]:
        t.join()
    errors = [r.error for r, _ in [*running, join] if r.error]
    if errors:
        raise SystemExit(f"error: {url}: {errors[0]}")
    return join_stats([r.chunk_times for r, _ in running], joined_at, join[0].chunk_times[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--chunks", default="0,256", help="prefill chunk sizes to compare (0: whole prompts)")
    ap.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                    help="measure through this OpenAI-compatible server instead (repeat to compare servers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, default=3)
    ap.add_argument("--running-input", type=int, default=128)
    ap.add_argument("--running-output", type=int, default=160)
    ap.add_argument("--join-after", type=int, default=16)
    ap.add_argument("--join-input", type=int, default=2000)
    ap.add_argument("--join-output", type=int, default=8)
    ap.add_argument("--threads", default="auto")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    if args.server:
        servers = dict(spec.split("=", 1) for spec in args.server if "=" in spec)
        if len(servers) != len(args.server) or args.artifact:
            ap.error("give --server NAME=URL (one or more) and no artifact, or an artifact and no --server")
        configs = list(servers)
        warm = argparse.Namespace(**{**vars(args), "running_output": args.join_after + 2, "join_input": 300})
        for url in servers.values():
            server_round(url, warm, rng)  # warm-up: first graph calls

        def measure(c):
            return server_round(servers[c], args, rng)
    else:
        if not args.artifact:
            ap.error("give an artifact (or --server NAME=URL)")
        configs = [int(c) for c in args.chunks.split(",")]
        model = CompiledModel.load(args.artifact,
                                   threads=args.threads if args.threads == "auto" else int(args.threads))
        one_round(model, configs[0], argparse.Namespace(**{**vars(args), "running_output": args.join_after + 2,
                                                           "join_input": 300}), rng)  # warm-up: first graph calls

        def measure(c):
            return one_round(model, c, args, rng)
    runs: dict = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for c in configs if rnd % 2 == 0 else configs[::-1]:
            got = measure(c)
            runs[c].append(got)
            print(f"round {rnd + 1} {c}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    print(f"\n{args.running} running sequences ({args.running_input}-token prompts, {args.running_output} tokens), "
          f"one {args.join_input}-token prompt joining; medians of {args.rounds} rounds")
    head = "server" if args.server else "chunk"
    print(f"{head:>8} | ITL p50 ms | p90 ms | max ms | p90/p50 | stall ms | join TTFT s")
    for c, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{c if c else 'whole':>8} | {med['itl_p50_ms']:10.1f} | {med['itl_p90_ms']:6.1f} | "
              f"{med['itl_max_ms']:6.0f} | {med['itl_p90_ms'] / med['itl_p50_ms']:7.2f} | {med['stall_ms']:8.0f} | "
              f"{med['join_ttft_s']:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
