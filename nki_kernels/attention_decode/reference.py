"""NumPy oracle for decode attention: the shared causal-GQA reference with explicit query positions.

Key j is visible to query token t of sequence b iff j <= positions[b, t]; cache entries past a sequence's valid
length (max position + 1) never contribute. Layout helpers turn [B, H, T, D] tensors into the kernel layout.
"""
from __future__ import annotations

import numpy as np

from nki_kernels.attention_prefill.reference import attention_reference  # noqa: F401  (the one oracle)


def to_kernel_layout(q, k, v, positions):
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], positions [B, T] -> (qT [B,Hq,D,T], kT [B,Hkv,D,S], v, pos fp32)."""
    qT = np.ascontiguousarray(np.swapaxes(q, 2, 3))   # [B, Hq, T, D] -> [B, Hq, D, T]
    kT = np.ascontiguousarray(np.swapaxes(k, 2, 3))   # [B, Hkv, S, D] -> [B, Hkv, D, S]
    pos = np.ascontiguousarray(np.asarray(positions, dtype=np.float32))   # exact for positions < 2**24
    return qT, kT, np.ascontiguousarray(v), pos
