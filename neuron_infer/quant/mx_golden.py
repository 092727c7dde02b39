"""OCP microscaling (MX) golden model in pure NumPy — the oracle for MX weights, the NKI simulator and MX kernels.

No torch import: this module is shared by `neuron_infer.quant.mx` (CPU weights), the NumPy NKI simulator and the
`nki_kernels/mx_matmul` tests. Every function is pure and deterministic (round-to-nearest-even via ml_dtypes).

Formats (`fmt`)
---------------
=========  ==============================  ===========  ==========================================
fmt        element dtype (ml_dtypes)       max finite   emax (exponent of the largest normal)
=========  ==============================  ===========  ==========================================
"e4m3fn"   float8_e4m3fn  (MXFP8)          448          8
"e5m2"     float8_e5m2    (MXFP8 alt.)     57344        15
"e2m1"     float4_e2m1fn  (MXFP4)          6            2
=========  ==============================  ===========  ==========================================

A block is 32 consecutive values along the block axis (the contraction dim). Its shared scale is an E8M0 byte
``b`` (value ``2**(b - 127)``; byte 0xFF = NaN is never produced). Scale rules (`rule`):

* ``"ocp"`` — OCP MX v1.0 reference: ``X = 2**(floor(log2(amax)) - emax)``; ``amax / X`` lies in
  ``[2**emax, 2**(emax+1))`` so the largest values may exceed the element max and are clipped (saturated) to it.
* ``"nki"`` — NKI >= 0.5 hardware `quantize_mx`: ``X = 2**(floor(log2(amax)) - (emax - 1))`` (2x the OCP scale),
  so ``amax / X < 2**emax`` and nothing clips (costs one bit of range for small values).

Both rules: an all-zero block gets byte 0 (X = 2**-127); the exponent is clamped to [-127, 127]; elements are
``clip(v / X, -max, max)`` cast with RNE. Inputs must be finite (NaN/inf raise ValueError).

Quad ("x4") layout of `nc_matmul_mx` (NKI ISA documentation)
-----------------------------------------------------------------
The hardware contracts over P partitions x 4 slots per tile (P in {32, 64, 96, 128}, tile = 4P contraction values).
Within tile t, contraction index ``k = t*4P + q*P + p`` is stored at partition ``t*P + p``, slot ``q``::

     logical K (one tile, P=128)            packed [P, F] words, 4 slots each
     k:   0 .. 127  | 128 .. 255 | 256 .. 383 | 384 .. 511
          slab q=0    slab q=1     slab q=2     slab q=3
                                                  partition p: [ k=p | k=128+p | k=256+p | k=384+p ]
                                                                  slot0  slot1     slot2     slot3

A hardware scale covers 8 partitions x 4 slots (one scale row g = p // 8 per tile). So the MX blocks the hardware
sees are NOT 32 contiguous k but ``{t*4P + q*P + 8g + j : q < 4, j < 8}``. We handle this with a permutation:
"quad order" lists the contraction axis partition-major, slot-minor (position ``t*4P + 4p + q`` holds
``k = t*4P + q*P + p``). In quad order each x4 word is 4 consecutive entries and each hardware block is 32
consecutive entries, so: ``to_quad_order`` -> `quantize` (ordinary contiguous blocks) -> `pack_x4`.

Words: fp8 x4 = little-endian uint32, slot q in byte q (bits 8q..8q+7); fp4 x4 = uint16, slot q in nibble q
(bits 4q..4q+3, low nibble first). Scales: [K/32, F] uint8 in quad order = per tile the logical [P/8, F] scale
tensor of §5.7 (row ``t*P/8 + g``); `scatter_scales_sbuf` gives the physical quadrant placement for P > 32.

API
---
* ``quantize(x, fmt, rule="ocp", axis=-1) -> (elements, scales)``: elements have x's shape and the ml_dtypes
  element dtype; scales are uint8 E8M0 bytes with the block axis shrunk 32x. The axis length must be a multiple
  of 32 (pad with zeros: `pad_axis`; zero padding never changes a block's scale nor a dot product).
* ``dequantize(elements, scales, axis=-1) -> float32``.
* ``element_codes(elements) -> uint8`` raw bits; ``elements_from_codes(codes, fmt)`` the inverse.
* ``quad_permutation(K, partitions=128) -> int64[K]``; ``to_quad_order(x, axis=0, partitions=128)``;
  ``from_quad_order(x, axis=0, partitions=128)``.
* ``pack_x4(elements, axis=0) -> uint32 | uint16`` (axis shrinks 4x); ``unpack_x4(words, fmt, axis=0)``.
* ``quantize_for_matmul(w_kf, fmt, rule="nki", partitions=128) -> (packed [K/4, F], scales [K/32, F])``.
* ``matmul_mx_golden(stat, mov, stat_scales, mov_scales, stat_fmt, mov_fmt, partitions=128) -> float32 [M, N]``:
  the §5.7 `nc_matmul_mx` math over all tiles (sum_{p,q} S[p,m,q] * V[p,n,q]).
* ``scatter_scales_sbuf(scales_pf, partitions=128) -> uint8 [P, F]``: logical row g at partition 32*(g//4)+g%4.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BLOCK = 32
SCALE_BIAS = 127
RULES = ("ocp", "nki")


@dataclass(frozen=True)
class MXFormat:
    name: str
    dtype: np.dtype
    max: float
    emax: int
    bits: int


FORMATS = {
    "e4m3fn": MXFormat("e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), 448.0, 8, 8),
    "e5m2": MXFormat("e5m2", np.dtype(ml_dtypes.float8_e5m2), 57344.0, 15, 8),
    "e2m1": MXFormat("e2m1", np.dtype(ml_dtypes.float4_e2m1fn), 6.0, 2, 4),
}


def get_format(fmt: str) -> MXFormat:
    if fmt not in FORMATS:
        raise ValueError(f"MX element format {fmt!r} is unknown; choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"MX scale rule {rule!r} is unknown; choose 'ocp' (OCP reference) or 'nki' (NKI>=0.5 HW)")


def pad_axis(x: np.ndarray, multiple: int, axis: int = -1) -> np.ndarray:
    """Zero-pad `axis` of `x` up to a multiple of `multiple` (a no-op when already aligned)."""
    n = x.shape[axis]
    extra = (-n) % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return np.pad(x, widths)


def _to_float32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "fV" and x.dtype not in (np.dtype(ml_dtypes.bfloat16),):
        raise ValueError(f"MX quantize needs a floating-point array, got dtype {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("MX quantize input contains NaN or inf; MX blocks need finite values")
    return x


def scale_exponents(amax: np.ndarray, fmt: str, rule: str = "ocp") -> np.ndarray:
    """Shared exponent per block (int32, in [-127, 127]) from the block absmax (float32, >= 0)."""
    f = get_format(fmt)
    _check_rule(rule)
    _, e = np.frexp(amax.astype(np.float32))  # amax = m * 2**e, m in [0.5, 1) -> floor(log2 amax) = e - 1
    exp = (e.astype(np.int32) - 1) - (f.emax if rule == "ocp" else f.emax - 1)
    exp = np.where(amax > 0, exp, -SCALE_BIAS)
    return np.clip(exp, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)


def quantize(x: np.ndarray, fmt: str, rule: str = "ocp", axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """MX-quantize `x` in blocks of 32 along `axis`. Returns (elements [x.shape] fmt dtype, scales uint8)."""
    f = get_format(fmt)
    x = np.moveaxis(_to_float32(x), axis, -1)  # [..., K]
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MX block axis has length {k}, not a multiple of {BLOCK}; zero-pad it first (pad_axis)")
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)  # [..., K/32, 32]
    exp = scale_exponents(np.abs(blocks).max(axis=-1), fmt, rule)  # [..., K/32]
    scaled = np.ldexp(blocks, -exp[..., None])  # exact power-of-two rescale, [..., K/32, 32]
    elems = np.clip(scaled, -f.max, f.max).astype(f.dtype).reshape(x.shape)  # RNE cast, [..., K]
    scales = (exp + SCALE_BIAS).astype(np.uint8)
    return np.moveaxis(elems, -1, axis), np.moveaxis(scales, -1, axis)


def dequantize(elements: np.ndarray, scales: np.ndarray, axis: int = -1) -> np.ndarray:
    """Inverse of `quantize`: element * 2**(scale - 127), float32, same shape as `elements`."""
    e = np.moveaxis(np.asarray(elements), axis, -1).astype(np.float32)  # [..., K]
    s = np.moveaxis(np.asarray(scales, dtype=np.uint8), axis, -1)  # [..., K/32]
    if e.shape[-1] != s.shape[-1] * BLOCK or e.shape[:-1] != s.shape[:-1]:
        raise ValueError(f"MX elements {e.shape} and scales {s.shape} disagree (need one scale per {BLOCK})")
    if (s == 0xFF).any():
        raise ValueError("MX scale byte 0xFF is NaN in E8M0; the scales are corrupt")
    blocks = e.reshape(*e.shape[:-1], -1, BLOCK)  # [..., K/32, 32]
    out = np.ldexp(blocks, s.astype(np.int32)[..., None] - SCALE_BIAS).reshape(e.shape)
    return np.moveaxis(out, -1, axis)


def element_codes(elements: np.ndarray) -> np.ndarray:
    """Raw bit patterns as uint8 (fp8: the byte; fp4: the code in the low nibble)."""
    return np.asarray(elements).view(np.uint8)


def elements_from_codes(codes: np.ndarray, fmt: str) -> np.ndarray:
    f = get_format(fmt)
    codes = np.asarray(codes, dtype=np.uint8)
    if f.bits == 4 and (codes > 0x0F).any():
        raise ValueError("fp4 codes must fit in 4 bits (0..15)")
    return codes.view(f.dtype)


# ---------------------------------------------------------------------------------------------------------------
# quad ("x4") layout


def _check_quad(k: int, partitions: int) -> None:
    if partitions not in (32, 64, 96, 128):
        raise ValueError(f"partitions={partitions} must be 32, 64, 96 or 128 (nc_matmul_mx contraction tile)")
    if k % (4 * partitions):
        raise ValueError(
            f"contraction length {k} is not a multiple of 4*partitions={4 * partitions}; zero-pad it (pad_axis)"
        )


def quad_permutation(k: int, partitions: int = 128) -> np.ndarray:
    """perm[i] = logical k stored at quad-order position i (i = t*4P + 4p + q holds k = t*4P + q*P + p)."""
    _check_quad(k, partitions)
    p = partitions
    grid = np.arange(k).reshape(k // (4 * p), 4, p)  # [T, q, p] = logical k
    return grid.transpose(0, 2, 1).reshape(k)  # [T, p, q] -> flat quad order


def to_quad_order(x: np.ndarray, axis: int = 0, partitions: int = 128) -> np.ndarray:
    return np.take(x, quad_permutation(x.shape[axis], partitions), axis=axis)


def from_quad_order(x: np.ndarray, axis: int = 0, partitions: int = 128) -> np.ndarray:
    inv = np.argsort(quad_permutation(x.shape[axis], partitions))
    return np.take(x, inv, axis=axis)


def pack_x4(elements: np.ndarray, axis: int = 0) -> np.ndarray:
    """Pack 4 consecutive elements along `axis` into one word (fp8 -> uint32 LE, fp4 -> uint16 low nibble first)."""
    el = np.asarray(elements)
    bits = 4 if el.dtype == np.dtype(ml_dtypes.float4_e2m1fn) else 8
    if el.dtype.itemsize != 1:
        raise ValueError(f"pack_x4 needs fp8/fp4 elements, got {el.dtype}")
    c = np.moveaxis(element_codes(el), axis, -1)  # [..., K]
    if c.shape[-1] % 4:
        raise ValueError(f"pack_x4 axis length {c.shape[-1]} is not a multiple of 4")
    c = c.reshape(*c.shape[:-1], -1, 4).astype(np.uint32)  # [..., K/4, 4 slots]
    shifts = np.arange(4, dtype=np.uint32) * bits  # slot q -> bits [q*bits, (q+1)*bits)
    words = (c << shifts).sum(axis=-1, dtype=np.uint32)  # [..., K/4]
    words = words.astype(np.uint16) if bits == 4 else words
    return np.moveaxis(words, -1, axis)


def unpack_x4(words: np.ndarray, fmt: str, axis: int = 0) -> np.ndarray:
    """Inverse of `pack_x4`: [.., K/4, ..] words -> [.., K, ..] elements of `fmt`."""
    f = get_format(fmt)
    want = np.uint16 if f.bits == 4 else np.uint32
    w = np.asarray(words)
    if w.dtype != want:
        raise ValueError(f"{fmt} x4 words must be {np.dtype(want).name}, got {w.dtype}")
    w = np.moveaxis(w, axis, -1).astype(np.uint32)  # [..., K/4]
    shifts = np.arange(4, dtype=np.uint32) * f.bits
    codes = (w[..., None] >> shifts) & np.uint32((1 << f.bits) - 1)  # [..., K/4, 4]
    codes = codes.reshape(*w.shape[:-1], -1).astype(np.uint8)  # [..., K]
    return np.moveaxis(elements_from_codes(codes, fmt), -1, axis)


def quantize_for_matmul(w_kf: np.ndarray, fmt: str, rule: str = "nki",
                        partitions: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """[K, F] operand -> (packed [K/4, F] x4 words, scales [K/32, F] uint8), hardware block grouping."""
    quad = to_quad_order(np.asarray(w_kf), axis=0, partitions=partitions)  # [K, F], quad order
    elems, scales = quantize(quad, fmt, rule, axis=0)  # blocks = 8 partitions x 4 slots
    return pack_x4(elems, axis=0), scales


def _unpacked_scaled(words: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(unpack_x4(words, fmt, axis=0), scales, axis=0)  # [K, F] float32, quad order


def matmul_mx_golden(stat: np.ndarray, mov: np.ndarray, stat_scales: np.ndarray, mov_scales: np.ndarray,
                     stat_fmt: str, mov_fmt: str, partitions: int = 128) -> np.ndarray:
    """`nc_matmul_mx` math over every tile: stat [K/4, M] x4, mov [K/4, N] x4 -> float32 [M, N].

    Same contraction order for both operands, so the quad permutation cancels: dst = S^T V over quad order.
    """
    s = _unpacked_scaled(stat, stat_scales, stat_fmt)  # [K, M]
    v = _unpacked_scaled(mov, mov_scales, mov_fmt)  # [K, N]
    if s.shape[0] != v.shape[0]:
        raise ValueError(f"contraction lengths differ: stationary {s.shape[0]} vs moving {v.shape[0]}")
    _check_quad(s.shape[0], partitions)
    return (s.astype(np.float64).T @ v.astype(np.float64)).astype(np.float32)  # [M, N]


def scatter_scales_sbuf(scales_pf: np.ndarray, partitions: int = 128) -> np.ndarray:
    """Logical per-tile scales [P/8, F] -> physical SBUF tile [P, F] (row g at partition 32*(g//4) + g%4).

    For P <= 32 the logical [P/8, F] tile is used as is (returned unchanged). Unused partitions hold 0.
    """
    s = np.asarray(scales_pf, dtype=np.uint8)
    if s.shape[0] * 8 != partitions:
        raise ValueError(f"scales have {s.shape[0]} rows; a {partitions}-partition tile needs {partitions // 8}")
    if partitions <= 32:
        return s
    out = np.zeros((partitions, s.shape[1]), np.uint8)
    g = np.arange(s.shape[0])
    out[32 * (g // 4) + g % 4] = s
    return out
