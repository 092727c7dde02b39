"""Module-level toy worker functions for the launcher tests (spawned ranks import them by name)."""
from __future__ import annotations

import os
import time

import torch

from neuron_infer.parallel.launch import (
    all_gather_last_dim,
    all_reduce_sum,
    broadcast_from_rank0,
    broadcast_object_from_rank0,
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


def tp_greedy(ctx, cfg_dict: dict, full_sd: dict, ids: torch.Tensor, steps: int) -> dict:
    """The Llama model on this rank's shard: prefill logits, then `steps` greedy decode steps (token chosen on
    rank 0 and broadcast). Returns prefill logits, per-step logits and the tokens (rank 0's view)."""
    from neuron_infer.artifact.weights import build_float_model
    from neuron_infer.config import BuildConfig, ModelConfig
    from neuron_infer.model.llama import LocalLayout
    from neuron_infer.model.op_tables import get_ops
    from neuron_infer.parallel.plan import ShardPlan
    from neuron_infer.parallel.shard import shard_state_dict

    cfg = ModelConfig.from_dict(cfg_dict)
    plan = ShardPlan.build(cfg, ctx.world_size)
    mine = plan.ranks[ctx.rank]
    ops = get_ops("reference").with_collectives(all_reduce_sum, all_gather_last_dim)
    model = build_float_model(cfg, BuildConfig(dtype="fp32"), shard_state_dict(full_sd, cfg, plan, ctx.rank),
                              LocalLayout(**mine.local_layout_fields()), ops)
    b, t = ids.shape
    cache_len = t + steps
    k = torch.zeros(cfg.num_layers, b, mine.num_kv_heads, cache_len, cfg.head_dim)  # [L, N=B, Hkv_local, bs=S, D]
    v = torch.zeros_like(k)
    table = torch.arange(b).view(b, 1)  # [B, 1]: row b in block b (one block per sequence)
    pos = torch.arange(t).expand(b, t)  # [B, T]
    with torch.no_grad():
        prefill = model(ids, pos, k, v, pos, cache_len, table)  # [B, T, V]
        token = broadcast_from_rank0(prefill[:, -1].argmax(-1, keepdim=True))  # [B, 1]
        tokens, step_logits = [token], []
        for i in range(steps - 1):
            p = torch.full((b, 1), t + i)  # [B, 1]
            logits = model(token, p, k, v, torch.zeros(b, 1, dtype=torch.long), cache_len, table)  # [B, 1, V]
            step_logits.append(logits)
            token = broadcast_from_rank0(logits[:, -1].argmax(-1, keepdim=True))
            tokens.append(token)
    return {"prefill": prefill, "steps": step_logits, "tokens": torch.cat(tokens, dim=1)}


def exit0_on(ctx, bad_rank: int) -> None:
    """A rank that leaves silently with exit code 0 (no result, no exception)."""
    all_reduce_sum(torch.ones(2))
    if ctx.rank == bad_rank:
        os._exit(0)
    all_reduce_sum(torch.ones(2))


def serve_sums(ctx) -> object:
    """Long-lived group set-up: returns the handler run for every request (pid and an all-reduce per call; the
    rank named in `request["hang_rank"]` sleeps `request["sleep_s"]` first)."""
    def handle(request: dict) -> dict:
        if ctx.rank == request.get("hang_rank"):
            time.sleep(request["sleep_s"])
        total = all_reduce_sum(torch.tensor([float(request["x"] * (ctx.rank + 1))]))
        pids = all_gather_last_dim(torch.tensor([os.getpid()], dtype=torch.int64))  # [world]
        return {"sum": total.item(), "pids": pids.tolist()}

    return handle


def rank_sampled_tokens(ctx, root: str, prompts: list[list[int]], n: int, agree_uniforms: bool = True,
                        temperature: float = 0.9) -> dict:
    """Load this rank's shard, generate unseeded sampled tokens; rank 0 returns every rank's tokens [tp][P][n].
    agree_uniforms=False agrees on sampled tokens [n] only (not on a speculative step's uniforms): the broken
    variant a test uses to show that per-rank draws would make the ranks diverge."""
    from pathlib import Path

    from neuron_infer.config import SamplingConfig
    from neuron_infer.runtime.generate import generate_ids
    from neuron_infer.runtime.loader import load_rank

    engine = load_rank(Path(root), ctx.rank)

    def agree(t: torch.Tensor) -> torch.Tensor:
        return broadcast_from_rank0(t) if agree_uniforms or t.dim() == 1 else t

    results, metrics = generate_ids(engine, prompts, n, SamplingConfig(temperature=temperature), ignore_eos=True,
                                    agree=agree)
    toks = torch.tensor([r.token_ids for r in results], dtype=torch.int64)  # [P, n]
    every = all_gather_last_dim(toks.unsqueeze(0).unsqueeze(-1))  # [1, P, n, tp]
    return {"tokens": every[0].permute(2, 0, 1).tolist(), "spec_steps": metrics.spec_steps}


def rank_gated_tokens(ctx, root: str, prompts: list[list[int]], n: int, agree_gate: bool = True) -> dict:
    """Greedy generation with the speculation gate under scripted step times that differ per rank: on rank 0 a
    speculative step costs 10 plain steps (never pays), on the others 1 (always pays). Rank 0 returns every rank's
    tokens [tp][P][n] and (spec, plain, gated) step counts [tp][3]. agree_gate=False leaves the gate's decision [1]
    unagreed (every other tensor is agreed): the broken variant."""
    from pathlib import Path

    from neuron_infer.runtime.generate import generate_ids
    from neuron_infer.runtime.loader import load_rank
    from neuron_infer.runtime.options import RunOptions
    from tests.speculation.scripted_clock import Scripted

    engine = load_rank(Path(root), ctx.rank)  # the SpecEngine of this rank
    Scripted(spec_cost=10.0 if ctx.rank == 0 else 1.0, probe_every=4).install(engine)

    def agree(t: torch.Tensor) -> torch.Tensor:
        return broadcast_from_rank0(t) if agree_gate or t.shape != (1,) else t

    results, m = generate_ids(engine, prompts, n, ignore_eos=True, agree=agree,
                              options=RunOptions(speculation_gate=True))
    toks = torch.tensor([r.token_ids for r in results], dtype=torch.int64)  # [P, n]
    every = all_gather_last_dim(toks.unsqueeze(0).unsqueeze(-1))  # [1, P, n, tp]
    steps = all_gather_last_dim(torch.tensor([[m.spec_steps, m.plain_steps, m.gated_steps]]).unsqueeze(-1))
    return {"tokens": every[0].permute(2, 0, 1).tolist(), "steps": steps[0].permute(1, 0).tolist()}  # [tp][3]
