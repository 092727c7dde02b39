"""Op dispatch: the few ops the Llama block calls, chosen once from `BuildConfig.kernels`.

The block never branches on kernels; it calls `ops.attention(...)`, `ops.mlp(...)`, `ops.rms_norm(...)`,
`ops.linear(...)`. `reference` ops are plain PyTorch and are the oracle for every other implementation. Kernels
reach a model only through its op table: the NKI kernels are the `nki` table; a backend that compiles with kernels
of its own traces the model with its table in place (`tables_replaced`; the CPU backend's is backends/cpu/ops.py).
Collectives (`all_reduce`, `all_gather_vocab`) are identity for a single rank and are bound by the TP runtime.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.shapes import known


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back before the weight multiply (as Hugging Face Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# Query rows (tokens x folded query heads) up to which attention is written as two fp32 reductions instead of SDPA.
# Decode (1 token x G heads) and speculative verification (K+1 tokens x G heads: K <= 7 at G <= 8, K <= 20 at
# SmolLM2's G = 3) land here: Inductor turns the reductions into one vectorised pass over the cached keys and one
# over the values, and every query row is reduced in the same order whatever the number of rows, so a verify pass
# computes what one-token steps compute, bit for bit (docs/cpu-backend.md, "Batch invariance"; a verify pass through
# SDPA differed in the last bits). A backend's op table may serve this case with a kernel of its own (the CPU
# backend's attention kernel, backends/cpu/ops.py, has the same property). Prefill keeps SDPA beyond 64 rows:
# its flash kernel tiles the T x S work, where the reductions would re-read K/V per query row.
FEW_QUERY_ROWS = 64


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [N, Hkv, bs, D] blocks, table [B, W] block ids -> the table's blocks as one sequence per row
    [B, Hkv, W*bs, D] (slot j = position j)."""
    b, w = table.shape
    _, hkv, bs, d = cache.shape
    blocks = cache.index_select(0, table.reshape(-1)).view(b, w, hkv, bs, d)  # [B, W, Hkv, bs, D]
    return blocks.transpose(1, 2).reshape(b, hkv, w * bs, d)  # [B, Hkv, W*bs, D]


def attention_ref(
    q: torch.Tensor,  # [B, Hq, T, D]  (RoPE applied)
    k_cache: torch.Tensor,  # [N, Hkv, bs, D] a layer's key blocks (this step's keys already written)
    v_cache: torch.Tensor,  # [N, Hkv, bs, D]
    table: torch.Tensor,  # [B, W] int64: row b's position j lives in block table[b, j // bs], slot j % bs
    q_to_kv: torch.Tensor | None,  # [Hq] int64: local KV head serving each local query head; None: head i uses
    # KV head i (Hq == Hkv, e.g. GQA groups folded into the token axis, see Ops.gqa_fold)
    positions: torch.Tensor,  # [B, T] absolute position of each query token
) -> torch.Tensor:  # [B, Hq, T, D]
    """Causal GQA attention over the blocks each row's table names: key j is visible to a query at position p iff
    j <= p."""
    k = gather_blocks(k_cache, table).to(q.dtype)  # [B, Hkv, S, D]
    v = gather_blocks(v_cache, table).to(q.dtype)  # [B, Hkv, S, D]
    return sequence_attention(q, k, v, q_to_kv, positions)


def sequence_attention(
    q: torch.Tensor,  # [B, Hq, T, D]
    k: torch.Tensor,  # [B, Hkv, S, D] a row's cached positions 0..S-1
    v: torch.Tensor,  # [B, Hkv, S, D]
    q_to_kv: torch.Tensor | None,  # as attention_ref's
    positions: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B, Hq, T, D]
    """attention_ref over K/V already laid out as one sequence per row: SDPA beyond FEW_QUERY_ROWS query rows, the
    fp32 reductions up to it."""
    if q_to_kv is not None:
        k = k.index_select(1, q_to_kv)  # [B, Hq, S, D]
        v = v.index_select(1, q_to_kv)  # [B, Hq, S, D]
    key_pos = torch.arange(k.shape[2], device=q.device)  # [S]
    visible = key_pos.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, S]
    if not known(q.shape[2] <= FEW_QUERY_ROWS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return few_rows_attention(q, k, v, visible)


def computed_once(t: torch.Tensor) -> torch.Tensor:
    """`t` itself (a same-layout view in eager); under Inductor, a fusion barrier: `t` is computed into its own
    buffer before the reductions that read it. Without it Inductor inlines cheap producers (RoPE, RMSNorm, the
    softmax normalisation) into the reduction loops that consume them, recomputing them for every output
    element."""
    return torch.as_strided(t, t.shape, t.stride())


def few_rows_attention(q, k, v, visible):
    """Attention for a few query rows as fp32 multiply-and-sum reductions (softmax in fp32, like SDPA)."""
    qs = computed_once(q.float() * q.shape[-1] ** -0.5)  # [B, H, T, D] scaled queries
    scores = (qs.unsqueeze(3) * k.float().unsqueeze(2)).sum(-1)  # [B,H,T,1,D]*[B,H,1,S,D] -> [B,H,T,S]
    probs = computed_once(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1))  # [B, H, T, S]
    out = (probs.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)  # [B,H,T,S,1]*[B,H,1,S,D] -> [B, H, T, D]
    return out.to(q.dtype)


def call_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The reference linear op: the module's own forward (a float nn.Linear or a quantized scheme's module)."""
    return module(x)


def mlp_ref(x: torch.Tensor, gate: nn.Module, up: nn.Module, down: nn.Module,
            linear: Callable[[nn.Module, torch.Tensor], torch.Tensor] = call_linear) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)), each projection applied by the table's `linear` op. Projections may be
    quantized modules (see neuron_infer.quant)."""
    return linear(down, F.silu(linear(gate, x)) * linear(up, x))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Ops:
    """The op table a model is built with. Swap entries, never branch inside the block."""

    name: str
    # The attention op accepts GQA query groups folded into the token axis (q [B, Hkv, G*T, D], positions
    # [B, G*T], q_to_kv=None), so K/V are never expanded per query head. A static capability of the
    # implementation, decided once; tables that do not declare it always get the head map q_to_kv.
    gqa_fold: bool = False
    rms_norm: Callable[..., torch.Tensor] = rms_norm_ref
    attention: Callable[..., torch.Tensor] = attention_ref
    # mlp(x, gate, up, down, linear): the block passes the table's own `linear`, so a backend's linear kernels
    # serve the MLP projections too
    mlp: Callable[..., torch.Tensor] = mlp_ref
    # linear(module, x [..., in]) -> [..., out]: every projection of the model (q/k/v/o, the MLP's, the head)
    linear: Callable[[nn.Module, torch.Tensor], torch.Tensor] = call_linear
    # The decoder layers run as one loop over their stacked weights (LlamaModel.stack_layers) where the model has
    # them: a compiler then traces and lowers one layer instead of every layer (the CPU backend's table sets it).
    loop_layers: bool = False
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    all_gather_vocab: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)

    def with_collectives(self, all_reduce: Callable, all_gather_vocab: Callable) -> "Ops":
        return replace(self, all_reduce=all_reduce, all_gather_vocab=all_gather_vocab)


@contextlib.contextmanager
def tables_replaced(module: nn.Module, change: Callable[[Ops], Ops]) -> Iterator[None]:
    """While active, every submodule of `module` that holds an op table holds change(table) instead: how a backend
    traces a model with its kernels (backends/cpu/ops.py) while the model itself keeps the table it was built with
    (the eager model stays the reference)."""
    held = [(m, m.ops) for m in module.modules() if isinstance(getattr(m, "ops", None), Ops)]
    changed: dict[int, Ops] = {}
    try:
        for m, ops in held:
            m.ops = changed.setdefault(id(ops), change(ops))
        yield
    finally:
        for m, ops in held:
            m.ops = ops
