#!/usr/bin/env python
"""Compiled-artifact costs measured in one process with the peers interleaved round by round (the machine is
shared and drifts between minutes: compare the ratios of one run, not absolute numbers across runs).

    # decode-step graphs of compiled artifacts: ms per call, ratio to the first graph listed (lower is better)
    python scripts/bench_engine.py graphs b4=ART_B4:tokengen_t1_s256 b1=ART_B4:tokengen_b1_t1_s256 \\
        verify=ART_NGRAM:verify_t5_s256 --rounds 9 --steps 10
    # one request through `CompiledModel.generate_ids`: decode tokens/s, ratio to the first (higher is better)
    python scripts/bench_engine.py generate bf16=ART_BF16 int8=ART_INT8 --rounds 7 --new-tokens 64
    # a tensor-parallel artifact: load, then the first and later `generate` calls on the loaded model (seconds)
    python scripts/bench_engine.py tp-calls ART_TP2 --calls 4 --new-tokens 8

`graphs` feeds each graph token 0 at positions P..P+T-1 of every row (`--position P`; default: the bucket's last T
positions, S-T..S-1) over distinct cache blocks per row, with the artifact's own KV cache. A step's attention reads
only the keys up to each row's position (the few-row attention kernel), so its cost grows with P; the default
times the most keys a bucket's step reads. `verify_t{T}_s{S}` graphs (speculation) get logits at all T positions,
as the runtime asks.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank, and then"
_NAME = re.compile(r"^(?P<kind>context|tokengen|verify)(_b(?P<b>\d+))?_t(?P<t>\d+)_s(?P<s>\d+)$")


def load(path: str, threads: int):
    from neuron_infer.api import CompiledModel

    return CompiledModel.load(path, threads=threads)


def graph_call(model, name: str, position: int | None):
    """(callable, args) for graph `name` of a loaded (tp = 1) model, at positions position.. (None: S - T..)."""
    from neuron_infer.artifact.plan import GraphSpec, example_args

    m = _NAME.match(name)
    if m is None:
        sys.exit(f"error: graph name {name!r} is not <kind>[_b<B>]_t<T>_s<S>")
    engine = model.engine
    graphs = dict(engine.graphs)
    if model.spec is not None:
        graphs.update(model.spec.graphs)
    if name not in graphs:
        sys.exit(f"error: {model.root} has no graph {name!r}; it has {sorted(graphs)}")
    t, s, kind = int(m["t"]), int(m["s"]), m["kind"]
    batch = int(m["b"]) if m["b"] else (1 if kind == "context" else engine.build.batch_size)
    ids, pos, _, _, idx, table = example_args(engine.cache_shape, GraphSpec(kind, t, s, batch))
    p0 = s - t if position is None else position
    if kind != "context":
        if not 0 <= p0 <= s - t:
            sys.exit(f"error: --position {p0} leaves no room for {t} tokens in a bucket of {s}")
        pos = pos + p0  # [B, T]
    blocks = engine.cache_shape.blocks
    table = (torch.arange(table.numel(), dtype=torch.int64) % (blocks - 1) + 1).view_as(table)  # [B, S/bs], no block 0
    idx = torch.arange(t, dtype=torch.int64).expand(batch, t).contiguous() if kind == "verify" else idx
    return graphs[name], (ids, pos, engine.k_cache, engine.v_cache, idx, table)


def print_rounds(samples: dict[str, list[float]], header: tuple[str, str, str, str], best, time_like: bool) -> None:
    """A Markdown table of per-round samples: median, best, and the median over rounds of each entry's time relative
    to the first entry's in the same round (samples are times when time_like, else rates)."""
    base = samples[next(iter(samples))]
    print("| " + " | ".join(header) + " |\n|---|---|---|---|")
    for label, xs in samples.items():
        ratio = statistics.median(x / y if time_like else y / x for x, y in zip(xs, base))
        print(f"| {label} | {statistics.median(xs):.2f} | {best(xs):.2f} | {ratio:.2f}x |")


def cmd_graphs(a) -> None:
    models, calls = {}, {}
    for item in a.items:
        label, _, rest = item.partition("=")
        path, _, name = rest.rpartition(":")
        if not (label and path and name):
            sys.exit(f"error: {item!r} is not LABEL=ARTIFACT:GRAPH")
        models.setdefault(path, load(path, a.threads))
        calls[label] = graph_call(models[path], name, a.position)
    ms = {k: [] for k in calls}
    with torch.inference_mode():
        for fn, args in calls.values():
            for _ in range(3):
                fn(*args)
        for _ in range(a.rounds):
            for label, (fn, args) in calls.items():
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    fn(*args)
                ms[label].append((time.perf_counter() - t0) / a.steps * 1e3)
    base = next(iter(calls))
    print(f"\n{a.threads} threads, {a.rounds} interleaved rounds x {a.steps} calls; ms per call (lower is better); "
          f"ratio = median over rounds of (graph / {base}) in the same round")
    print_rounds(ms, ("graph", "median ms", "min ms", f"vs {base}"), best=min, time_like=True)


def cmd_generate(a) -> None:
    runs = {}
    for item in a.items:
        label, _, path = item.partition("=")
        if not (label and path):
            sys.exit(f"error: {item!r} is not LABEL=ARTIFACT")
        runs[label] = load(path, a.threads)
    tps = {k: [] for k in runs}
    for rnd in range(a.rounds + 1):  # round 0 warms up, not recorded
        for label, m in runs.items():
            ids = m.encode(PROMPT)
            out = m.generate_ids([ids], a.new_tokens, ignore_eos=True)
            if rnd:
                tps[label].append(out.tokens_per_s)
    base = next(iter(runs))
    print(f"\n{a.threads} threads, one request, {a.new_tokens} new tokens, {a.rounds} interleaved rounds; decode "
          f"tokens/s (higher is better); ratio = median over rounds of ({base} / artifact) time per token")
    print_rounds(tps, ("artifact", "median tok/s", "max tok/s", f"time per token vs {base}"), best=max,
                 time_like=False)


def cmd_tp_calls(a) -> None:
    t0 = time.perf_counter()
    m = load(a.artifact, a.threads)
    print(f"load (starts {m.manifest.build.tp_degree} rank processes): {time.perf_counter() - t0:.2f} s")
    try:
        ids = m.encode(PROMPT)
        for i in range(a.calls):
            t0 = time.perf_counter()
            out = m.generate_ids([ids], a.new_tokens, ignore_eos=True)
            wall = time.perf_counter() - t0
            print(f"generate call {i + 1}: {wall:.3f} s wall, TTFT {out.ttft_s * 1e3:.0f} ms, "
                  f"rank pids {m.group.last_run.get('pids') if m.group else '-'}")
    finally:
        m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("graphs", help="ms per call of compiled graphs: LABEL=ARTIFACT:GRAPH ...")
    g.add_argument("items", nargs="+")
    g.add_argument("--rounds", type=int, default=9)
    g.add_argument("--steps", type=int, default=10)
    g.add_argument("--position", type=int, default=None,
                   help="first position of each step (default: the bucket's last T positions)")
    g.set_defaults(fn=cmd_graphs)
    r = sub.add_parser("generate", help="decode tokens/s of one request: LABEL=ARTIFACT ...")
    r.add_argument("items", nargs="+")
    r.add_argument("--rounds", type=int, default=7)
    r.add_argument("--new-tokens", type=int, default=64)
    r.set_defaults(fn=cmd_generate)
    t = sub.add_parser("tp-calls", help="seconds of the first and later generate calls on a loaded tp artifact")
    t.add_argument("artifact")
    t.add_argument("--calls", type=int, default=4)
    t.add_argument("--new-tokens", type=int, default=8)
    t.set_defaults(fn=cmd_tp_calls)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
