"""Tensor-engine instructions: nc_matmul (accumulate, transpose mode, double_row) and nc_transpose
(NKI documentation)."""
from __future__ import annotations

import numpy as np

from . import checks as C
from . import dtypes as D
from . import runtime
from .enums import matmul_perf_mode as PM
from .enums import require
from .errors import SimulationError

_MATMUL_IN = (D.float8_e4m3, D.float8_e4m3fn, D.float8_e5m2, D.bfloat16, D.float16, D.tfloat32, D.float32)


def _check_dtypes(stat, mov, dst, gen: int, op: str) -> None:
    for role, t in (("stationary", stat), ("moving", mov)):
        if t.dtype not in _MATMUL_IN:
            raise SimulationError(f"{op} {role} dtype {D.dtype_name(t.dtype)} is not a TensorE input type "
                                  f"(fp8 e4m3/e4m3fn/e5m2, bf16, fp16, tf32, fp32)")
        if t.dtype == D.float8_e4m3fn and gen < 4:
            raise SimulationError(f"{op} {role} float8_e4m3fn needs gen4 (trn3); use float8_e4m3 on {gen and f'gen{gen}'}")
    wide = {D.float32, D.tfloat32}
    if (stat.dtype in wide) != (mov.dtype in wide):
        raise SimulationError(f"{op}: fp32/tf32 operands must be paired with fp32/tf32 (got stationary "
                              f"{D.dtype_name(stat.dtype)}, moving {D.dtype_name(mov.dtype)})")
    if {stat.dtype, mov.dtype} == {D.float8_e4m3, D.float8_e4m3fn}:
        raise SimulationError(f"{op} cannot mix float8_e4m3 and float8_e4m3fn operands")
    allowed = (D.float32,) if gen < 4 else (D.float32, D.bfloat16)
    if dst.dtype not in allowed:
        raise SimulationError(f"{op} dst (PSUM) dtype must be {' or '.join(map(D.dtype_name, allowed))} on gen{gen}, "
                              f"got {D.dtype_name(dst.dtype)}")


def check_bank(dst, op: str) -> None:
    """gen2/3: one matmul's output must sit inside one 2 KiB PSUM bank per partition (§2.7, A.6)."""
    ctx = runtime.current()
    if ctx.gen >= 4:
        return
    pstride = dst.partition_stride()
    lo = dst.offset % pstride + sum(min(0, s * (c - 1)) for s, c in dst.dims[1:])
    hi = dst.offset % pstride + sum(max(0, s * (c - 1)) for s, c in dst.dims[1:])
    size = D.itemsize(dst.dtype)
    bank = ctx.target.psum_bank_bytes
    if (lo * size) // bank != (hi * size + size - 1) // bank:
        raise SimulationError(f"{op} output {dst.shape} spans PSUM bytes [{lo * size}, {hi * size + size}) which "
                              f"crosses a {bank} B bank boundary; on gen{ctx.gen} one matmul writes one bank (N <= 512 fp32)")


def check_accumulate(accumulate, op: str):
    """``accumulate`` must be None, True or False (NumPy bools from ``k > 0`` are accepted)."""
    if accumulate is not None and not isinstance(accumulate, (bool, np.bool_)):
        raise SimulationError(f"{op} accumulate must be None, True or False, got {accumulate!r}")
    return None if accumulate is None else bool(accumulate)


def accumulate_into(dst, result: np.ndarray, accumulate, op: str) -> None:
    """PSUM write with the accumulate flag: None = overwrite unwritten elements, add to matmul-written ones."""
    bits = dst.storage.matmul_bits()
    idx = dst.index().reshape(dst.shape[0], -1)
    seen = bits[idx]
    if accumulate is True and not seen.all():
        runtime.warn(f"{op} accumulate=True into PSUM {dst.name!r} elements never written by a matmul "
                     f"(undefined on hardware); use accumulate=(k > 0) or None")
    add = np.ones_like(seen) if accumulate is True else (np.zeros_like(seen) if accumulate is False else seen)
    old = C.read_2d(dst)
    C.store(dst, C.cast_for(dst, np.where(add, old + result, result)), by_matmul=True)


def _tiling(tile_position, tile_size, gen, op):
    if not tile_position and not tile_size:
        return None
    if not tile_position or not tile_size:
        raise SimulationError(f"{op}: tile_position and tile_size must be set together")
    sizes = (32, 64, 128) if gen >= 3 else (64, 128)
    (r0, c0), (rows, cols) = tile_position, tile_size
    if rows not in sizes or cols not in sizes or r0 % rows or c0 % cols or r0 + rows > 128 or c0 + cols > 128:
        raise SimulationError(f"{op}: tile_size {tile_size} must be in {sizes} and tile_position {tile_position} "
                              f"a multiple of it inside the 128x128 array")
    return rows, cols


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=PM.none, name=None):
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` in fp32 (§5.1)."""
    op = "nc_matmul"
    dst, st, mv = C.tensor(dst, op, "dst"), C.tensor(stationary, op, "stationary"), C.tensor(moving, op, "moving")
    require(perf_mode, PM, op, "perf_mode")
    ctx = runtime.current()
    C.buffers(st, ("sbuf",), op, "stationary")
    C.buffers(mv, ("sbuf",), op, "moving")
    C.buffers(dst, ("psum",), op, "dst")
    C.writable(dst, op)
    accumulate = check_accumulate(accumulate, op)
    if is_transpose:
        return _transpose_mode(dst, st, mv, ctx, op)
    double = perf_mode == PM.double_row
    k = C.same_partitions(op, stationary=st, moving=mv)
    tiles = _tiling(tile_position, tile_size, ctx.gen, op)
    if double:
        _check_double_row(st, mv, tiles, ctx.gen, op)
    m, n = C.free(st) // (2 if double else 1), C.free(mv) // (2 if double else 1)
    rows, cols = tiles or (128, 128)
    _check_dtypes(st, mv, dst, ctx.gen, op)
    if k > rows or m > cols:
        raise SimulationError(f"{op} contraction K={k} / stationary free M={m} exceed the PE array tile "
                              f"({rows} rows x {cols} columns)")
    n_max = ctx.target.matmul_n_max(D.itemsize(dst.dtype))
    if n > n_max:
        raise SimulationError(f"{op} moving free size N={n} exceeds {n_max} on gen{ctx.gen}")
    if dst.shape[0] != m or C.free(dst) != n:
        raise SimulationError(f"{op} dst {dst.shape} must be [M={m}, N={n}] (stationary {st.shape}, moving {mv.shape})")
    check_bank(dst, op)
    if ctx.execute:
        if double:   # contraction over (partition, j): sum_{p,j} S[p,j,m] * V[p,j,n]
            s2 = C.read_f32(st).reshape(k * 2, m)   # [K, 2, M] -> [2K, M] (p-major)
            v2 = C.read_f32(mv).reshape(k * 2, n)   # [K, 2, N] -> [2K, N]
        else:
            s2, v2 = C.read_2d(st), C.read_2d(mv)    # [K, M], [K, N] (extra free dims flattened)
        accumulate_into(dst, s2.T @ v2, accumulate, op)
    return C.emit("tensor", op, mv, dst, partitions=k, free_elems=n,
                  matmul_kmn=(k * (2 if double else 1), m, n), perf_mode="double_row" if double else None)


def _check_double_row(st, mv, tiles, gen, op) -> None:
    if gen < 3:
        raise SimulationError(f"{op} perf_mode=double_row needs gen3+ (trn2/trn3)")
    fp8 = (D.float8_e4m3, D.float8_e5m2) + ((D.float8_e4m3fn,) if gen >= 4 else ())
    if st.dtype not in fp8 or mv.dtype not in fp8:
        raise SimulationError(f"{op} perf_mode=double_row needs fp8 operands, got {D.dtype_name(st.dtype)} and "
                              f"{D.dtype_name(mv.dtype)}")
    if st.ndim != 3 or mv.ndim != 3 or st.shape[1] != 2 or mv.shape[1] != 2:
        raise SimulationError(f"{op} perf_mode=double_row needs [K, 2, M] and [K, 2, N] operands, got "
                              f"{st.shape} and {mv.shape}")
    if tiles is not None:
        raise SimulationError(f"{op} perf_mode=double_row cannot be combined with PE tiling")


def _transpose_mode(dst, st, mv, ctx, op):
    """is_transpose=True: bit-exact transpose of ``stationary`` via an identity ``moving`` (gen3+ semantics)."""
    k = C.same_partitions(op, stationary=st, moving=mv)
    m = C.free(st)
    if k > 128 or m > 128:
        raise SimulationError(f"{op} transpose input {st.shape} exceeds 128x128")
    if mv.shape[0] != k or C.free(mv) != k:
        raise SimulationError(f"{op} is_transpose=True needs a [{k}, {k}] identity moving tile, got {mv.shape}")
    if dst.shape[0] != m or C.free(dst) != k:
        raise SimulationError(f"{op} transpose dst must be [{m}, {k}], got {dst.shape}")
    if dst.dtype not in (st.dtype, D.float32) and D.itemsize(st.dtype) > 1:
        raise SimulationError(f"{op} is_transpose=True writes the stationary dtype {D.dtype_name(st.dtype)} "
                              f"or fp32; dst is {D.dtype_name(dst.dtype)}")
    if ctx.execute:
        vals = st.read().reshape(k, m).T if dst.dtype == st.dtype else C.cast_for(dst, C.read_2d(st).T)
        C.store(dst, vals, by_matmul=True)
    return C.emit("tensor", op, mv, dst, partitions=k, free_elems=k, matmul_kmn=(k, m, k), is_transpose=True)


def nc_transpose(dst, data, engine=None, name=None):
    """Partition <-> free transpose: TensorE (<=128x128, SBUF -> PSUM) or VectorE (<=32x32) (§5.1)."""
    op = "nc_transpose"
    dst, x = C.tensor(dst, op, "dst"), C.tensor(data, op, "data")
    default = "tensor" if dst.kind == "psum" and x.kind == "sbuf" else "vector"
    eng = C.engine_name(engine, default, op, ("tensor", "vector"))
    p, f = C.pdim(x, op, "data"), C.free(x)
    limit = 128 if eng == "tensor" else 32
    if p > limit or f > limit:
        raise SimulationError(f"{op} on the {eng} engine supports at most [{limit}, {limit}], got {x.shape}")
    if eng == "tensor":
        C.buffers(x, ("sbuf",), op, "data")
        C.buffers(dst, ("psum",), op, "dst")
    else:
        C.buffers(x, ("sbuf", "psum"), op, "data")
        C.buffers(dst, ("sbuf", "psum"), op, "dst")
    if dst.dtype != x.dtype:
        raise SimulationError(f"{op} dst dtype {D.dtype_name(dst.dtype)} must equal data dtype {D.dtype_name(x.dtype)}")
    if dst.shape[0] != f or C.free(dst) != p:
        raise SimulationError(f"{op} dst must be [{f}, {p}] for data {x.shape}, got {dst.shape}")
    C.writable(dst, op)
    if C.executing():
        C.store(dst, x.read().reshape(p, f).T, by_matmul=eng == "tensor")
    # free_elems = F of the input (cost §9.2: max(P, min(64, F))); as a PE op it is a matmul with an identity
    # moving tile: K = p, M = f, N = p
    return C.emit(eng, op, x, dst, **({"matmul_kmn": (p, f, p)} if eng == "tensor" else {}))
