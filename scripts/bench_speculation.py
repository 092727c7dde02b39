"""CS1 on CPU: tokens/s and acceptance vs speculation length K, self-draft of SmolLM2, baseline interleaved.

    python scripts/bench_speculation.py --draft-layers 10 --ks 1,2,4,6,8,12,16 --backend cpu-eager
    python scripts/bench_speculation.py --draft-quant int8 --ks 2,4,8

For each K: target-only greedy decoding (the baseline), speculative greedy decoding unfused (host loop over
draft/verify graphs) and fused (one graph per step), both ungated (every step speculates: the fixed-K measurement),
and fused with the speculation gate (plain steps while speculation is measured not to pay, see
docs/speculation.md), in `--repeats` interleaved rounds on the CS1 prompt; medians are printed. The baseline is
re-measured next to every K because this machine is shared (results move 10-25% between runs). Every speculative
output is checked token for token against the baseline output (greedy is lossless).

Backends: `cpu-eager` runs the modules as they are (no compile; quick to start). `cpu` compiles every graph with
AOTInductor first (minutes per K for SmolLM2 on 2 cores), which is what `neuron-infer compile` produces.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_infer.artifact.plan import cache_shape, planned_graphs
from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint, load_tokenizer
from neuron_infer.compile.spec_builder import build_draft, compile_speculation
from neuron_infer.config import BuildConfig, ModelConfig, SpeculationConfig
from neuron_infer.model.llama import BucketStep
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import eager_spec_engine, load_speculation
from neuron_infer.runtime.options import RunOptions

PROMPT = "I am at KDD conference in Barcelona. After the conference tutorial today I will"


def engine_for(target, draft, build: BuildConfig, backend: str, work: Path):
    """SpecEngine with graphs from `backend` (eager modules, or compiled into `work`)."""
    if backend == "cpu-eager":
        return eager_spec_engine(target, draft, build)
    from neuron_infer.backends import get_backend

    be, gdir = get_backend(backend), work / "graphs"
    core = {}
    for spec in planned_graphs(build):
        step = BucketStep(target, spec.attend)
        from neuron_infer.artifact.plan import example_args

        be.compile_graph(step, example_args(cache_shape(target, build), spec), gdir, spec.name)
        core[spec.name] = be.load_graph(gdir, spec.name, step)
    engine = Engine(core, build, cache_shape(target, build), target.cfg.vocab_size)
    _, record = compile_speculation(MODEL_DIR, target.cfg, build, target, be, work, lambda m: None)
    manifest = types.SimpleNamespace(build=build, extra=types.SimpleNamespace(speculation=record), backend=backend)
    return load_speculation(work, manifest, target, engine)


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix: in bf16 the K+1-token verify pass rounds differently from the 1-token decode
    pass, so a near-tie can flip (fp32 runs must agree fully; the tiny-model tests check exact identity)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def interleaved(runs: dict, repeats: int) -> dict[str, tuple[float, object]]:
    """name -> (median decode tokens/s, last output) over `repeats` rounds, each round running every entry once."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, object] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name] = fn()
            rates[name].append(out[name][1].tokens_per_s)
    return {name: (statistics.median(rates[name]), out[name]) for name in runs}


def run_k(k: int, args, cfg, target, prompt_ids) -> dict:
    spec = SpeculationConfig("self", k, fused=True, draft_quant=args.draft_quant,
                             draft_layers=args.draft_layers)
    build = BUILD.replace(speculation=spec)
    draft, _ = build_draft(MODEL_DIR, cfg, build)
    with tempfile.TemporaryDirectory() as work:
        se = engine_for(target, draft, build, args.backend, Path(work))
        n = args.max_new_tokens
        runs = {"baseline": lambda: generate_ids(se.target, [prompt_ids], n, ignore_eos=True)}
        for mode in ("unfused", "fused"):
            runs[mode] = lambda mode=mode: generate_ids(se.with_mode(mode), [prompt_ids], n, ignore_eos=True)
        gated_rounds: list[float] = []  # the gate keeps its measurements on the engine: round 1 measures

        def gated():
            out = generate_ids(se.with_mode("fused"), [prompt_ids], n, ignore_eos=True,
                               options=RunOptions(speculation_gate=True))
            gated_rounds.append(out[1].tokens_per_s)
            return out

        runs["gated"] = gated
        got = interleaved(runs, args.repeats)
        base = got["baseline"][1]
        row = {"k": k, "baseline": got["baseline"][0]}
        for mode in ("unfused", "fused", "gated"):
            tps, (res, m) = got[mode]
            row[mode], row[f"agree_{mode}"] = tps, agreement(res[0].token_ids, base[0][0].token_ids)
            if args.dtype == "fp32" and row[f"agree_{mode}"] < n:
                raise SystemExit(f"K={k} {mode}: fp32 speculative greedy output differs from the target's")
            if mode == "fused":
                row["acceptance"], row["tokens_per_step"] = m.acceptance_rate, m.mean_accepted_tokens_per_step
            if mode == "gated":
                row["gated_steps"] = f"{m.spec_steps}/{m.plain_steps}"
                row["gate"], row["gated_rounds"] = m.gate, gated_rounds
    return row


def main() -> None:
    global MODEL_DIR, BUILD
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--draft-layers", type=int, default=None)
    ap.add_argument("--draft-quant", default="none")
    ap.add_argument("--backend", default="cpu-eager", choices=["cpu-eager", "cpu"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.embedded import default_model_dir

    MODEL_DIR = default_model_dir(log=print)
    cfg = ModelConfig.from_model_dir(MODEL_DIR)
    BUILD = BuildConfig(dtype=args.dtype, max_context_length=32, max_length=128, context_buckets=(32,),
                        tokengen_buckets=(128,))
    prompt_ids = list(load_tokenizer(MODEL_DIR)(PROMPT)["input_ids"])
    target = build_float_model(cfg, BUILD, load_checkpoint(MODEL_DIR, cfg))
    draft_desc = f"layers={args.draft_layers or cfg.num_layers}/{cfg.num_layers} quant={args.draft_quant}"
    print(f"SmolLM2-135M {args.dtype}, backend {args.backend}, self-draft {draft_desc}, {args.max_new_tokens} "
          f"new tokens, CS1 prompt ({len(prompt_ids)} tokens), {args.threads} threads, median of {args.repeats}")
    print("speedup = speculative / baseline decode tok/s (below 1: slower than plain); gated: fused with the "
          "speculation gate, spec/plain = its speculative and plain steps (last round)")
    print(f"{'K':>3} | {'baseline tok/s':>14} | {'unfused tok/s':>13} | {'fused tok/s':>11} | {'gated tok/s':>11} | "
          f"{'speedup u/f/g':>16} | {'acceptance':>10} | {'tokens/step':>11} | {'spec/plain':>10} | agree u/f/g")
    for k in [int(x) for x in args.ks.split(",")]:
        t0 = time.perf_counter()
        r = run_k(k, args, cfg, target, prompt_ids)
        b = r["baseline"]
        speedup = f"{r['unfused'] / b:.2f}/{r['fused'] / b:.2f}/{r['gated'] / b:.2f}"
        print(f"{k:>3} | {b:>14.1f} | {r['unfused']:>13.1f} | {r['fused']:>11.1f} | {r['gated']:>11.1f} | "
              f"{speedup:>16} | {r['acceptance']:>10.2f} | {r['tokens_per_step']:>11.2f} | {r['gated_steps']:>10} | "
              f"{r['agree_unfused']}/{r['agree_fused']}/{r['agree_gated']} of {args.max_new_tokens}"
              f"   ({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
        g = r["gate"]
        print(f"      gate (last round): plain step {g['plain_ms']:.1f} ms (the target alone), speculative step "
              f"{g['spec_ms']:.1f} ms, {g['tokens_per_spec_step']:.2f} tokens per speculative step: payoff "
              f"{g['payoff']:.2f}; the draft's catch-up {g['catch_up_ms_per_position']:.1f} ms per position; gated "
              f"tok/s per round {', '.join(f'{x:.1f}' for x in r['gated_rounds'])} (the gate's measurements carry "
              "over from round to round)", flush=True)


MODEL_DIR: Path
BUILD: BuildConfig

if __name__ == "__main__":
    main()
