"""NumPy oracle for the fused MLP kernels and the host-side weight packing they consume.

Weights are given as W[K, N] = nn.Linear.weight.T: gate/up [H, I], down [I, H]. The kernels take them in the
tiled layout of neuron_infer/tiling.py (`pack_weight`), FP8 weights as Neuron E4M3 bytes with per-output-channel
fp32 scales laid out [128, N/128] (`pack_scales`).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from neuron_infer.tiling import TILE, tile_weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def rms_norm_reference(x, gamma, eps):
    """x [N, H] -> x / sqrt(mean(x^2) + eps) * gamma in float64."""
    x64 = np.asarray(x, dtype=np.float64)
    return x64 / np.sqrt((x64 ** 2).mean(axis=-1, keepdims=True) + eps) * np.asarray(gamma, dtype=np.float64)


def mlp_reference(x, wg, wu, wd, scales=None, gamma=None, eps=1e-5):
    """down(silu(gate(n)) * up(n)) in float64; n = rmsnorm(x) * gamma when gamma is given.

    wg/wu [H, I], wd [I, H] (float, or fp8 codes with `scales` = (sg [I], su [I], sd [H]) applied after each
    matmul, as the Neuron FP8 linear does).
    """
    n = rms_norm_reference(x, gamma, eps) if gamma is not None else np.asarray(x, dtype=np.float64)
    w = [np.asarray(a, dtype=np.float64) for a in (wg, wu, wd)]
    s = [np.ones(a.shape[1]) for a in w] if scales is None else [np.asarray(a, np.float64) for a in scales]
    g = (n @ w[0]) * s[0]                                  # [N, I]
    u = (n @ w[1]) * s[1]                                  # [N, I]
    return ((silu(g) * u) @ w[2]) * s[2]                   # [N, H]


def pack_weight(w_kn, dtype=None):
    """W [K, N] -> tiled [128, ceil(N/128), ceil(K/128), 128] (zero padded), optionally cast to `dtype`."""
    w = np.asarray(w_kn) if dtype is None else np.asarray(w_kn).astype(dtype)
    return tile_weight(w)


def pack_scales(scale_n):
    """Per-output-channel scales [N] -> [128, ceil(N/128)] fp32; channel nt*128 + p sits at [p, nt] (pad 1.0)."""
    s = np.asarray(scale_n, dtype=np.float32)
    n_pad = -(-s.shape[0] // TILE) * TILE
    padded = np.ones(n_pad, dtype=np.float32)
    padded[: s.shape[0]] = s
    return np.ascontiguousarray(padded.reshape(n_pad // TILE, TILE).T)   # [N/128, 128] -> [128, N/128]


def quantize_fp8_weight(w_kn):
    """W [K, N] float -> (Neuron E4M3 codes [K, N] with |v| <= 240, fp32 scale [N] = absmax / 240)."""
    w = np.asarray(w_kn, dtype=np.float32)
    scale = np.maximum(np.abs(w).max(axis=0) / 240.0, np.finfo(np.float32).tiny)    # [N]
    codes = np.clip(w / scale, -240.0, 240.0).astype(ml_dtypes.float8_e4m3)      # RNE, in range
    return codes, scale.astype(np.float32)
