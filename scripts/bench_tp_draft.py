"""Draft model at tp > 1: replicated on every rank vs sharded like the target, one draft token step, CPU ranks.

    python scripts/bench_tp_draft.py --tp 2 --steps 200 --rounds 3                 # tiny random draft
    python scripts/bench_tp_draft.py --tp 2 --draft-dir PATH --dtype bf16          # a real draft checkpoint

Each of `--tp` gloo rank processes builds the draft twice from the same checkpoint: whole (plain ops, no
collectives: what every rank runs when the draft is replicated) and as its shard of the draft's own ShardPlan
(all-reduce after o_proj / down_proj / embedding, vocab all-gather: what a sharded draft runs). Both decode the same
one-token steps into their own KV caches (batch 1, positions 0..steps-1, the draft's token-generation step of a
speculative step), interleaved over `--rounds`; rank 0 prints the median ms per draft token of each and the draft
weight bytes per rank. Without --draft-dir a tiny random checkpoint (tests/tiny_checkpoint.py) is written first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from neuron_infer.artifact.plan import cache_shape
from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.compile.tp import RankSet
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.model.llama import BucketStep
from neuron_infer.parallel.launch import run_ranks
from neuron_infer.parallel.plan import ShardPlan


def _time_steps(model, build: BuildConfig, steps: int) -> float:
    """Seconds per one-token step over positions 0..steps-1 (a fresh cache)."""
    cache = cache_shape(model, build)
    k, v = cache.allocate()  # [L, N, Hkv, bs, D]
    step = BucketStep(model, build.max_length)
    idx = torch.zeros(1, 1, dtype=torch.int64)  # [1, 1]
    table = torch.arange(1, 1 + build.max_length // cache.block_size).view(1, -1)  # [1, S/bs]: block 0 is scratch
    with torch.inference_mode():
        step(torch.ones(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), k, v, idx, table)  # warm-up
        t0 = time.perf_counter()
        for p in range(steps):
            step(torch.full((1, 1), 5 + p % 100, dtype=torch.int64), torch.full((1, 1), p, dtype=torch.int64),
                 k, v, idx, table)
        return (time.perf_counter() - t0) / steps


def rank_bench(ctx, draft_dir: str, dtype: str, steps: int, rounds: int) -> dict | None:
    cfg = ModelConfig.from_model_dir(Path(draft_dir))
    s = -(-(steps + 1) // 16) * 16  # one bucket of >= steps + 1 positions, whole 16-token (or larger) KV blocks
    build = BuildConfig(dtype=dtype, max_context_length=s, max_length=s, tp_degree=ctx.world_size)
    state = load_checkpoint(Path(draft_dir), cfg)
    whole = build_float_model(cfg, build, state)
    plan = ShardPlan.build(cfg, ctx.world_size)
    shard = RankSet(plan.tp, plan, "cpu-eager", None, False).float_model(cfg, build, state, ctx.rank)
    got = {"replicated": [], "sharded": []}
    for _ in range(rounds):
        got["replicated"].append(_time_steps(whole, build, steps))
        got["sharded"].append(_time_steps(shard, build, steps))  # every rank: its collectives pair up

    def nbytes(m) -> int:
        return sum(t.numel() * t.element_size() for t in m.state_dict().values())

    if ctx.rank != 0:
        return None
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in got.items()}, "plan": plan.summary(),
            "bytes": {"replicated": nbytes(whole), "sharded": nbytes(shard)}, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--draft-dir", default=None)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = a.draft_dir
        if draft_dir is None:
            from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

            draft_dir = str(write_tiny_checkpoint(Path(tmp) / "draft", **TINY_PRESETS["gqa"]))
        out = run_ranks(rank_bench, a.tp, (draft_dir, a.dtype, a.steps, a.rounds), timeout_s=1800)
    print(f"draft {a.draft_dir or 'tiny gqa (tests/tiny_checkpoint.py)'}, {a.dtype}, tp {a.tp} "
          f"({out['plan']}), {out['threads']} thread(s)/rank, {a.steps} steps x {a.rounds} rounds")
    for k in ("replicated", "sharded"):
        print(f"  {k:10s} {out['ms'][k]:8.3f} ms / draft token   {out['bytes'][k] / 2**20:9.2f} MiB draft "
              f"weights / rank")
    print(f"  sharded / replicated time: {out['ms']['sharded'] / out['ms']['replicated']:.2f}x")


if __name__ == "__main__":
    main()
