"""Module-level toy worker functions for the launcher tests (spawned ranks import them by name)."""
from __future__ import annotations

import os
import signal
import time

import torch

from neuron_infer.parallel.launch import (
    all_gather_last_dim, all_reduce_sum, broadcast_from_rank0, broadcast_object_from_rank0,
)


def collectives(ctx, n: int) -> dict:
    """Each rank contributes rank-dependent tensors; rank 0 returns what the collectives produced."""
    x = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)  # [n]
    summed = all_reduce_sum(x.clone())
    half = all_reduce_sum(torch.full((3,), 0.5 * (ctx.rank + 1), dtype=torch.bfloat16))
    gathered = all_gather_last_dim(torch.full((2, 2), float(ctx.rank)))  # [2, 2 * world]
    token = broadcast_from_rank0(torch.tensor([100 + ctx.rank]))
    obj = broadcast_object_from_rank0({"from": ctx.rank})
    ctx.emit(("hello from rank", ctx.rank))
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": summed, "half": half, "gathered": gathered,
            "token": token, "obj": obj, "threads": torch.get_num_threads()}


def raise_on(ctx, bad_rank: int) -> None:
    all_reduce_sum(torch.ones(2))
    if ctx.rank == bad_rank:
        raise ValueError(f"boom on rank {ctx.rank}")
    all_reduce_sum(torch.ones(2))


def hang_on(ctx, bad_rank: int, sleep_s: float) -> None:
    all_reduce_sum(torch.ones(2))
    if ctx.rank == bad_rank:
        time.sleep(sleep_s)
    all_reduce_sum(torch.ones(2))


def report_pids_then_loop(ctx, steps: int) -> int:
    """Rank 0 emits every rank's pid, then all ranks loop over all-reduces (so a rank can be killed mid-run)."""
    pids = all_gather_last_dim(torch.tensor([os.getpid()], dtype=torch.int64))
    ctx.emit(pids.tolist())
    for _ in range(steps):
        all_reduce_sum(torch.ones(4))
        time.sleep(0.05)
    return steps


def sigkill_self_on(ctx, bad_rank: int) -> None:
    all_reduce_sum(torch.ones(2))
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce_sum(torch.ones(2))
