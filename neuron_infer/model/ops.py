"""Op dispatch: the few ops the Llama block calls, chosen once from `BuildConfig.kernels`.

The block never branches on kernels; it calls `ops.attention(...)`, `ops.mlp(...)`, `ops.rms_norm(...)`.
`reference` ops are plain PyTorch and are the oracle for every other implementation (NKI kernels plug in here).
Collectives (`all_reduce`, `all_gather_vocab`) are identity for a single rank and are bound by the TP runtime.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

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
# SDPA differed in the last bits). The CPU backend replaces the reductions with its attention kernel where it
# applies (backends/cpu/cpu_attention.cpp, same property; `few_rows_attention_kernel`). Prefill keeps SDPA beyond 64 rows:
# its flash kernel tiles the T x S work, where the reductions would re-read K/V per query row.
FEW_QUERY_ROWS = 64

# attention(q, k_cache, v_cache, table, positions) -> out, and the test whether it takes (q, k_cache, v_cache): a
# backend's kernel for the few-row case while that backend exports (`few_rows_attention_kernel`), reading the block
# caches in place; the gather and the reductions below are its reference.
FewRowsAttention = tuple[Callable[..., torch.Tensor], Callable[..., bool]]
_few_rows_kernel: FewRowsAttention | None = None


@contextlib.contextmanager
def few_rows_attention_kernel(kernel: FewRowsAttention | None) -> Iterator[None]:
    """While active, attention on at most FEW_QUERY_ROWS query rows (GQA groups folded: q_to_kv None) calls
    kernel[0](q, k_cache, v_cache, table, positions) when kernel[1](q, k_cache, v_cache) accepts the operands (dtypes
    and shapes are static at export)."""
    global _few_rows_kernel
    saved = _few_rows_kernel
    _few_rows_kernel = kernel
    try:
        yield
    finally:
        _few_rows_kernel = saved


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
    if (q_to_kv is None and known(q.shape[2] <= FEW_QUERY_ROWS) and _few_rows_kernel is not None
            and _few_rows_kernel[1](q, k_cache, v_cache)):
        return _few_rows_kernel[0](q, k_cache, v_cache, table, positions)
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


def mlp_ref(x: torch.Tensor, gate: torch.nn.Module, up: torch.nn.Module, down: torch.nn.Module) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)). Projections may be quantized modules (see neuron_infer.quant)."""
    return down(F.silu(gate(x)) * up(x))


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
    mlp: Callable[..., torch.Tensor] = mlp_ref
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    all_gather_vocab: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)

    def with_collectives(self, all_reduce: Callable, all_gather_vocab: Callable) -> "Ops":
        return replace(self, all_reduce=all_reduce, all_gather_vocab=all_gather_vocab)
