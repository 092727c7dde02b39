"""Host-side MX packing helpers and the oracle for the MX matmul kernel, both built on neuron_infer/quant/mx_golden.

The kernel contracts K in tiles of 512 = 128 partitions x 4 quad slots, so K is zero-padded to a multiple of 512
(zero rows change neither a block scale nor a dot product). Weights are quantized with the hardware block
grouping (8 partitions x 4 slots) by `mx_golden.quantize_for_matmul`; activations are quantized the way the
on-chip `quantize_mx` does (NKI >= 0.5 rule, e4m3fn).
"""
from __future__ import annotations

import numpy as np

from neuron_infer.quant import mx_golden as mg

K_TILE = 512


def pad_k(x, axis):
    """Zero-pad `axis` to a multiple of 512 (the kernel's contraction tile)."""
    return mg.pad_axis(np.asarray(x), K_TILE, axis=axis)


def pack_mx_weight(w_kf, fmt, rule=None):
    """W [K, F] float -> (words [Kp/4, F] uint32 (e4m3fn) / uint16 (e2m1), scales [Kp/32, F] uint8), Kp = pad(K).

    rule: scale rule ("nki" for MXFP8, "ocp" for MXFP4 by default — the choices of neuron_infer.quant.mx).
    """
    rule = rule or ("ocp" if fmt == "e2m1" else "nki")
    w = pad_k(np.asarray(w_kf, dtype=np.float32), axis=0)               # [Kp, F]
    words, scales = mg.quantize_for_matmul(w, fmt, rule=rule)
    return np.ascontiguousarray(words), np.ascontiguousarray(scales)


def mx_matmul_reference(x_nk, words, scales, fmt):
    """What the kernel computes: quantize_mx(x) (nki rule, e4m3fn, hardware grouping) times the packed weight.

    x_nk [N, Kp] bf16 (already padded) -> [N, F] float32 via mx_golden.matmul_mx_golden.
    """
    xq, xs = mg.quantize_for_matmul(np.asarray(x_nk).astype(np.float32).T, "e4m3fn", rule="nki")  # [Kp/4, N]
    return mg.matmul_mx_golden(xq, words, xs, scales, "e4m3fn", fmt)


def dequantized_weight(words, scales, fmt):
    """Packed weight -> float32 W [Kp, F] (logical contraction order)."""
    quad = mg.dequantize(mg.unpack_x4(words, fmt, axis=0), scales, axis=0)   # [Kp, F] in quad order
    return mg.from_quad_order(quad, axis=0)
