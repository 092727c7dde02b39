"""Prefill arithmetic rate: GFLOP/s of a compiled artifact's prefill against this machine's measured GEMM peak.

    python scripts/bench_prefill_flops.py --artifacts A16,A8,AW
    python scripts/bench_prefill_flops.py --artifacts A16 --tokens 25,105,420 --threads 1 --calls 20

Peak: the best GFLOP/s of ATen's bf16 GEMM (oneDNN) on large square matrices (1024 and 2048) at the same thread
count, best of several calls: what this CPU sustains on a GEMM, not a data-sheet number. Prefill: `Engine.prefill_row`
on a fresh slot, median of --calls calls after two warm-ups, counted as the model's multiply-adds x 2:
    linears   tokens x (q, k, v, o, gate, up, down weights) x layers
    attention tokens x (tokens + 1) / 2 positions x heads x head_dim x 2 (QK^T and PV) x layers (causal)
    head      vocab x hidden for the logit row
Prints one Markdown row per (artifact, tokens): ms (lower is better), GFLOP/s and the share of the peak (higher is
better). int8 and w8a8 artifacts are counted with the same multiply-adds (their products are int8 x int16 or
int8 x int8, not bf16: the share says how close they come to a bf16 GEMM's rate).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from neuron_infer.api import CompiledModel


def gemm_peak(calls: int = 5) -> float:
    """Best GFLOP/s of a bf16 square GEMM (1024, 2048) at the current thread count."""
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n).to(torch.bfloat16), torch.randn(n, n).to(torch.bfloat16)
        torch.mm(a, b)
        for _ in range(calls):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def prefill_flops(cfg, tokens: int) -> float:
    """Multiply-adds x 2 of one prefill of `tokens` tokens from position 0 (see the module docstring)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    linear = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    attention = tokens * (tokens + 1) / 2 * cfg.num_heads * d * 2
    return 2 * (cfg.num_layers * (tokens * linear + attention) + cfg.vocab_size * h)


def time_prefill(model: CompiledModel, tokens: int, calls: int) -> float:
    """Median seconds of one prefill of `tokens` tokens into slot 0."""
    engine = model.engine
    blocks = -(-(tokens + 1) // engine.build.block_size)
    engine.bind(0, list(range(1, blocks + 1)))
    prompt = [100 + t % 1000 for t in range(tokens)]
    for _ in range(2):
        engine.prefill_row(0, prompt)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        engine.prefill_row(0, prompt)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True, help="comma-separated compiled artifact directories")
    ap.add_argument("--tokens", default="25,105,420", help="prompt lengths (default 25,105,420)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = gemm_peak()
    print(f"{torch.get_num_threads()} threads; measured bf16 GEMM peak {peak:.0f} GFLOP/s (ATen mm, 1024-2048 square)\n")
    print("| artifact | quant | prompt tokens | prefill ms | GFLOP/s | share of the GEMM peak |")
    print("|---|---|---|---|---|---|")
    for root in args.artifacts.split(","):
        model = CompiledModel.load(root)
        cfg, quant = model.manifest.model, model.manifest.build.quant.scheme
        for tokens in (int(t) for t in args.tokens.split(",")):
            s = time_prefill(model, tokens, args.calls)
            rate = prefill_flops(cfg, tokens) / s / 1e9
            print(f"| {root} | {quant} | {tokens} | {s * 1e3:.1f} | {rate:.0f} | {rate / peak:.0%} |")
        model.close()


if __name__ == "__main__":
    main()
