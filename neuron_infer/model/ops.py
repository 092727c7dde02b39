"""Op dispatch: the few ops the Llama block calls, chosen once from `BuildConfig.kernels`.

The block never branches on kernels; it calls `ops.attention(...)`, `ops.mlp(...)`, `ops.rms_norm(...)`.
`reference` ops are plain PyTorch and are the oracle for every other implementation (NKI kernels plug in here).
Collectives (`all_reduce`, `all_gather_vocab`) are identity for a single rank and are bound by the TP runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

from neuron_infer.errors import ConfigError


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back before the weight multiply (as Hugging Face Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def attention_ref(
    q: torch.Tensor,  # [B, Hq, T, D]  (RoPE applied)
    k: torch.Tensor,  # [B, Hkv, S, D] cache prefix (this step's keys already written)
    v: torch.Tensor,  # [B, Hkv, S, D]
    q_to_kv: torch.Tensor,  # [Hq] int64: local KV head serving each local query head
    positions: torch.Tensor,  # [B, T] absolute position of each query token
) -> torch.Tensor:  # [B, Hq, T, D]
    """Causal GQA attention over a static cache prefix: key j is visible to a query at position p iff j <= p."""
    k = k.index_select(1, q_to_kv)  # [B, Hq, S, D]
    v = v.index_select(1, q_to_kv)  # [B, Hq, S, D]
    key_pos = torch.arange(k.shape[2], device=q.device)  # [S]
    mask = key_pos.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def mlp_ref(x: torch.Tensor, gate: torch.nn.Module, up: torch.nn.Module, down: torch.nn.Module) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)). Projections may be quantized modules (see neuron_infer.quant)."""
    return down(F.silu(gate(x)) * up(x))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Ops:
    """The op table a model is built with. Swap entries, never branch inside the block."""

    name: str
    rms_norm: Callable[..., torch.Tensor] = rms_norm_ref
    attention: Callable[..., torch.Tensor] = attention_ref
    mlp: Callable[..., torch.Tensor] = mlp_ref
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)
    all_gather_vocab: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity)

    def with_collectives(self, all_reduce: Callable, all_gather_vocab: Callable) -> "Ops":
        return replace(self, all_reduce=all_reduce, all_gather_vocab=all_gather_vocab)


def _reference_ops() -> Ops:
    return Ops(name="reference")


def _nki_ops() -> Ops:
    try:
        from neuron_infer.model import nki_ops  # noqa: PLC0415 - lazy: pulls in the NKI kernels / simulator
    except ImportError as e:
        raise ConfigError(f"kernels='nki' is not available in this build ({e}); use kernels='reference'") from e
    return nki_ops.build_ops()


_REGISTRY: dict[str, Callable[[], Ops]] = {"reference": _reference_ops, "nki": _nki_ops}


def get_ops(kernels: str) -> Ops:
    """Return the op table for `BuildConfig.kernels` ('reference' | 'nki')."""
    if kernels not in _REGISTRY:
        raise ConfigError(f"kernels={kernels!r} is unknown; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[kernels]()
