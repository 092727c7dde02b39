#!/usr/bin/env python3
"""A long prompt joins running sequences: how much does it stall them? Chunked prefill vs whole prompts.

    python scripts/bench_join.py ARTIFACT --chunks 0,256 --rounds 3 --running 3 --running-input 128 \
        --running-output 160 --join-input 2000

In-process, on neuron-infer's runtime (the loop of `generate`: one Runner step over the decoding sequences, then the
prefill of new and still-encoding prompts). Per round and chunk size (alternating, the order reversed every round):
`--running` sequences start (`--running-input` token prompts, `--running-output` tokens each); once each has
`--join-after` tokens, one sequence with a `--join-input` token prompt joins. Prompts are fresh random token ids, and
prefix caching is off. Reported per chunk size (medians over rounds; 0 = whole prompts):
  ITL p50 / p90 / max  the running sequences' gaps between tokens over the whole run,
  stall                their longest gap while the long prompt was being encoded,
  join TTFT            the long prompt's time to its first token.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from neuron_infer.api import CompiledModel
from neuron_infer.config import SamplingConfig
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.runner import Runner
from neuron_infer.runtime.sampling import make_generator
from neuron_infer.runtime.sequence import Sequence, StopRule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the serving benchmark's statistics
from bench_serving import percentile  # noqa: E402


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
    first = times[join][0]
    spans = [(a, b) for s in running for a, b in zip(times[s], times[s][1:])]
    itl = [b - a for a, b in spans]
    during = [b - a for a, b in spans if b > joined_at and a < first]
    return {"itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p90_ms": 1e3 * percentile(itl, 90),
            "itl_max_ms": 1e3 * max(itl), "stall_ms": 1e3 * max(during, default=0.0),
            "join_ttft_s": first - joined_at}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--chunks", default="0,256", help="prefill chunk sizes to compare (0: whole prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, default=3)
    ap.add_argument("--running-input", type=int, default=128)
    ap.add_argument("--running-output", type=int, default=160)
    ap.add_argument("--join-after", type=int, default=16)
    ap.add_argument("--join-input", type=int, default=2000)
    ap.add_argument("--join-output", type=int, default=8)
    ap.add_argument("--threads", default="auto")
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    model = CompiledModel.load(args.artifact, threads=args.threads if args.threads == "auto" else int(args.threads))
    rng = random.Random(0)
    one_round(model, chunks[0], argparse.Namespace(**{**vars(args), "running_output": args.join_after + 2,
                                                      "join_input": 300}), rng)  # warm-up: first graph calls
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    for rnd in range(args.rounds):
        for c in chunks if rnd % 2 == 0 else chunks[::-1]:
            got = one_round(model, c, args, rng)
            runs[c].append(got)
            print(f"round {rnd + 1} chunk {c}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    print(f"\n{args.running} running sequences ({args.running_input}-token prompts, {args.running_output} tokens), "
          f"one {args.join_input}-token prompt joining; medians of {args.rounds} rounds")
    print(f"{'chunk':>6} | ITL p50 ms | p90 ms | max ms | p90/p50 | stall ms | join TTFT s")
    for c, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{c if c else 'whole':>6} | {med['itl_p50_ms']:10.1f} | {med['itl_p90_ms']:6.1f} | "
              f"{med['itl_max_ms']:6.0f} | {med['itl_p90_ms'] / med['itl_p50_ms']:7.2f} | {med['stall_ms']:8.0f} | "
              f"{med['join_ttft_s']:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
