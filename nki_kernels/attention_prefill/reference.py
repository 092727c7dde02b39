"""NumPy oracle for causal GQA attention (prefill and decode share it) and the host-side layout helpers.

`attention_reference` is the math the kernels must reproduce, in float64: key j is visible to a query at absolute
position p iff j <= p (and j < valid length, which the positions imply).
"""
from __future__ import annotations

import numpy as np


def attention_reference(q, k, v, q_to_kv, positions, scale):
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], q_to_kv [Hq] ints, positions [B, T] ints -> [B, Hq, T, D] float64."""
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    idx = np.asarray(q_to_kv, dtype=np.int64)
    kh, vh = k64[:, idx], v64[:, idx]                                   # [B, Hq, S, D]
    s = np.einsum("bhtd,bhsd->bhts", q64, kh) * scale                   # [B, Hq, T, S]
    key_pos = np.arange(k64.shape[2])
    visible = key_pos[None, None, :] <= np.asarray(positions)[:, :, None]   # [B, T, S]
    s = np.where(visible[:, None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bhsd->bhtd", p, vh)                          # [B, Hq, T, D]


def causal_reference(q, k, v, q_to_kv, scale):
    """Prefill from position 0: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D] float64."""
    b, _, s, _ = q.shape
    positions = np.broadcast_to(np.arange(s), (b, s))                   # [B, S]
    return attention_reference(q, k, v, q_to_kv, positions, scale)


def to_kernel_layout(q, k, v):
    """[B, H, S, D] q/k/v -> (qT [B, Hq, D, S], kT [B, Hkv, D, S], v [B, Hkv, S, D]) contiguous."""
    qT = np.ascontiguousarray(np.swapaxes(q, 2, 3))   # [B, Hq, S, D] -> [B, Hq, D, S]
    kT = np.ascontiguousarray(np.swapaxes(k, 2, 3))   # [B, Hkv, S, D] -> [B, Hkv, D, S]
    return qT, kT, np.ascontiguousarray(v)
