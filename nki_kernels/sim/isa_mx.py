"""Microscaling (MX) instructions of NeuronCore-v4: quantize_mx and nc_matmul_mx (NKI documentation).

Layouts: an x4 word packs 4 values of consecutive free positions (slot q in byte q for fp8, nibble q for fp4,
little-endian). One E8M0 scale covers 8 partitions x one x4 element; logical scale row g (= partition // 8) lives
at partition ``32*(g//4) + g%4`` of the scale view (quadrant placement; for P <= 32 that is simply row g).
"""
from __future__ import annotations

import numpy as np

from . import checks as C
from . import dtypes as D
from . import runtime
from .errors import SimulationError
from .isa_tensor import accumulate_into, check_accumulate

_EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
_SCALE_TYPES = (D.float8_e8m0fnu, D.uint8)


def scale_rows(groups: int) -> np.ndarray:
    g = np.arange(groups)
    return 32 * (g // 4) + g % 4


def _scale_view_rows(scale, groups: int, op: str, role: str) -> np.ndarray:
    rows = scale_rows(groups)
    if scale.dtype not in _SCALE_TYPES:
        raise SimulationError(f"{op} {role} dtype must be float8_e8m0fnu or uint8, got {D.dtype_name(scale.dtype)}")
    if scale.shape[0] <= rows[-1]:
        raise SimulationError(f"{op} {role} needs at least {rows[-1] + 1} partitions for {groups} scale rows "
                              f"(quadrant layout row g -> partition 32*(g//4)+g%4), got {scale.shape}")
    return rows


def unpack_x4(words: np.ndarray, dt) -> np.ndarray:
    """[..., F] x4 words -> [..., F, 4] fp32 values (slot q = byte/nibble q)."""
    if dt.container == np.uint32:
        codes = np.ascontiguousarray(words).view(np.uint8).reshape(*words.shape, 4)  # little-endian bytes
    else:
        codes = np.stack([(words >> (4 * q)) & 0xF for q in range(4)], axis=-1).astype(np.uint8)
    return codes.view(dt.element).astype(np.float32)


def pack_x4(values: np.ndarray, dt) -> np.ndarray:
    """[..., F, 4] element values (already representable) -> [..., F] x4 words."""
    codes = np.ascontiguousarray(values.astype(dt.element)).view(np.uint8)
    if dt.container == np.uint32:
        return codes.reshape(-1).view(np.uint32).reshape(values.shape[:-1])
    c = codes.astype(np.uint16)
    return (c[..., 0] | c[..., 1] << 4 | c[..., 2] << 8 | c[..., 3] << 12).astype(np.uint16)


def quantize_mx(dst, src, dst_scale, name=None):
    """MXFP8 quantisation (gen4 VectorE): per 8 partitions x 4 values, X = 2**(floor(log2 amax) - (Emax - 1)),
    data = fp8(v / X), scale byte = exponent + 127 (0 for an all-zero group); NKI 0.5+ rule (§5.7)."""
    op = "quantize_mx"
    C.gen_at_least(4, op)
    dst, x, sc = C.tensor(dst, op, "dst"), C.tensor(src, op, "src"), C.tensor(dst_scale, op, "dst_scale")
    for role, t in (("dst", dst), ("src", x), ("dst_scale", sc)):
        C.buffers(t, ("sbuf",), op, role)
    if x.dtype not in (D.bfloat16, D.float16):
        raise SimulationError(f"{op} src must be bf16 or fp16, got {D.dtype_name(x.dtype)}")
    if D.dtype_name(dst.dtype) not in _EMAX:
        raise SimulationError(f"{op} dst must be float8_e4m3fn_x4 or float8_e5m2_x4, got {D.dtype_name(dst.dtype)}")
    p, f = C.pdim(x, op, "src"), C.free(x)
    if p % 32 or f % 4:
        raise SimulationError(f"{op} src partitions ({p}) must be a multiple of 32 and free size ({f}) of 4")
    if dst.shape[0] != p or C.free(dst) != f // 4:
        raise SimulationError(f"{op} dst must be [{p}, {f // 4}] x4 words for src {x.shape}, got {dst.shape}")
    groups = p // 8
    rows = _scale_view_rows(sc, groups, op, "dst_scale")
    if C.free(sc) != f // 4:
        raise SimulationError(f"{op} dst_scale must have {f // 4} elements per partition, got {sc.shape}")
    if C.executing():
        data, scale = _quantize(C.read_2d(x), _EMAX[D.dtype_name(dst.dtype)], dst.dtype)
        C.store(dst, data)
        full = sc.read().reshape(sc.shape[0], -1).view(np.uint8).copy()
        full[rows] = scale
        C.store(sc, full.view(sc.np_dtype))
    return C.emit("vector", op, x, dst)


def _quantize(v: np.ndarray, emax: int, dt):
    """v [P, F] fp32 -> (words [P, F/4], scale bytes [P/8, F/4])."""
    p, f = v.shape
    blocks = v.reshape(p // 8, 8, f // 4, 4)                       # [G, 8, F/4, 4]
    amax = np.abs(blocks).max(axis=(1, 3))                          # [G, F/4]
    with np.errstate(divide="ignore"):
        exp = np.floor(np.log2(amax)) - (emax - 1)
    exp = np.where(amax > 0, np.clip(exp, -127, 127), -127).astype(np.int64)
    scaled = blocks / np.exp2(exp)[:, None, :, None]                # [G, 8, F/4, 4]
    words = pack_x4(scaled.reshape(p, f // 4, 4), dt)               # [P, F/4]
    return words, (exp + 127).astype(np.uint8)


def _scaled_operand(t, scale, groups, op, role):
    """[P, F] x4 operand -> [P*4, F] fp32 with each element multiplied by its 2**(scale - 127)."""
    rows = _scale_view_rows(scale, groups, op, f"{role}_scale")
    p, f = t.shape[0], C.free(t)
    if C.free(scale) != f:
        raise SimulationError(f"{op} {role}_scale must have {f} elements per partition, got {scale.shape}")
    if not C.executing():
        return None
    vals = unpack_x4(t.read().reshape(p, f), t.dtype)                # [P, F, 4]
    sbytes = scale.read().reshape(scale.shape[0], f).view(np.uint8)[rows].astype(np.float32)  # [G, F]
    mult = np.where(sbytes == 255, np.nan, np.exp2(sbytes - 127)).astype(np.float32)
    vals = vals * np.repeat(mult, 8, axis=0)[:, :, None]            # scale row g covers partitions 8g..8g+7
    return vals.transpose(0, 2, 1).reshape(p * 4, f)                 # [P, F, 4] -> [P, 4, F] -> [4P, F]


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """gen4 MX matmul: ``dst[m, n] (+)= sum_{p,q} S[p,m,q] * V[p,n,q]`` with per-block scales (§5.7)."""
    op = "nc_matmul_mx"
    C.gen_at_least(4, op)
    dst, st, mv = C.tensor(dst, op, "dst"), C.tensor(stationary, op, "stationary"), C.tensor(moving, op, "moving")
    ss, ms = C.tensor(stationary_scale, op, "stationary_scale"), C.tensor(moving_scale, op, "moving_scale")
    for role, t in (("stationary", st), ("moving", mv), ("stationary_scale", ss), ("moving_scale", ms)):
        C.buffers(t, ("sbuf",), op, role)
        if role in ("stationary", "moving") and not D.is_x4(t.dtype):
            raise SimulationError(f"{op} {role} must be an x4 MX dtype (float8_e4m3fn_x4, float8_e5m2_x4, "
                                  f"float4_e2m1fn_x4), got {D.dtype_name(t.dtype)}")
    C.buffers(dst, ("psum",), op, "dst")
    C.writable(dst, op)
    accumulate = check_accumulate(accumulate, op)
    p = C.same_partitions(op, stationary=st, moving=mv)
    m, n = C.free(st), C.free(mv)
    if p not in (32, 64, 96, 128):
        raise SimulationError(f"{op} partition count must be 32, 64, 96 or 128, got {p}")
    if m > 128 or m % 2:
        raise SimulationError(f"{op} stationary free size M={m} must be even and <= 128")
    if dst.dtype not in (D.float32, D.bfloat16):
        raise SimulationError(f"{op} dst must be fp32 or bf16 PSUM, got {D.dtype_name(dst.dtype)}")
    n_max = runtime.current().target.matmul_n_max(D.itemsize(dst.dtype))
    if n > n_max:
        raise SimulationError(f"{op} moving free size N={n} exceeds {n_max}")
    if dst.shape[0] != m or C.free(dst) != n:
        raise SimulationError(f"{op} dst {dst.shape} must be [M={m}, N={n}]")
    s2 = _scaled_operand(st, ss, p // 8, op, "stationary")
    v2 = _scaled_operand(mv, ms, p // 8, op, "moving")
    if C.executing():
        accumulate_into(dst, s2.T @ v2, accumulate, op)
    return C.emit("tensor", op, mv, dst, partitions=p, free_elems=n, matmul_kmn=(4 * p, m, n), perf_mode="mx")
