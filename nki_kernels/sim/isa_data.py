"""Data movement and initialisation instructions: dma_copy, dma_transpose, tensor_copy, memset, iota
(NKI documentation)."""
from __future__ import annotations

import math

import numpy as np

from . import checks as C
from . import dtypes as D
from .enums import dge_mode as DGE
from .enums import oob_mode as OOB
from .enums import require
from .errors import SimulationError


def _copy_values(dst, src, op) -> None:
    """dst <- src: bit copy when dtypes match, else src -> fp32 -> dst."""
    if dst.dtype == src.dtype and dst.np_dtype == src.np_dtype:
        C.store(dst, src.read())
    elif D.is_x4(dst.dtype) or D.is_x4(src.dtype):
        raise SimulationError(f"{op} between {D.dtype_name(src.dtype)} and {D.dtype_name(dst.dtype)}: packed MX "
                              f"data cannot be converted; reinterpret one side with .view(...) so the dtypes match")
    else:
        C.write(dst, C.read_f32(src))


def _converted(dst, src, values):
    """src storage values -> dst storage values (bit copy for equal dtypes, else through fp32)."""
    if dst.dtype == src.dtype and dst.np_dtype == src.np_dtype:
        return values
    return C.cast_for(dst, D.to_f32(values, src.dtype))


def _copy_skipping_oob(dst, src) -> None:
    """oob_mode.skip: rows of the HBM side (indirect vector_offset rows, or a pattern moved by scalar_offset) that
    fall outside the tensor are not read (dst keeps its values) or not written."""
    if not src.on_chip:
        idx = src.index(oob_skip=True)
        ok = idx >= 0
        vals = _converted(dst, src, src.storage.typed(src.np_dtype)[np.where(ok, idx, 0)]).reshape(-1)
        C.store(dst, np.where(ok.reshape(-1), vals, dst.read().reshape(-1)))
    else:
        idx = dst.index(oob_skip=True)
        ok = idx >= 0
        vals = _converted(dst, src, src.read()).reshape(idx.shape)
        dst.storage.typed(dst.np_dtype)[idx[ok]] = vals[ok]


def dma_copy(dst, src, priority=None, oob_mode=OOB.error, dge_mode=DGE.unknown, engine=None, name=None):
    """``dst = src`` through a DMA queue; HBM<->SBUF, HBM<->HBM, SBUF<->SBUF; never from PSUM (§5.4)."""
    op = "dma_copy"
    dst, src = C.tensor(dst, op, "dst"), C.tensor(src, op, "src")
    require(oob_mode, OOB, op, "oob_mode")
    dge_mode = require(dge_mode, DGE, op, "dge_mode")
    C.buffers(src, ("hbm", "sbuf"), op, "src")
    C.buffers(dst, ("hbm", "sbuf"), op, "dst")
    C.writable(dst, op)
    for role, t in (("dst", dst), ("src", src)):
        C.pdim(t, op, role)
    if dst.size != src.size:
        raise SimulationError(f"{op} element counts differ: dst {dst.shape} ({dst.size}) vs src {src.shape} ({src.size})")
    if dst.size == 0:   # an empty nl.ds(x, 0) slice: nothing to move
        return C.emit("dma", op, src, dst, partitions=0, free_elems=0, dma_bytes=0)
    if dge_mode == DGE.hwdge and dst.dtype != src.dtype:
        raise SimulationError(f"{op} with dge_mode=hwdge needs equal dtypes (src {D.dtype_name(src.dtype)}, dst "
                              f"{D.dtype_name(dst.dtype)}); reinterpret with .view() or use another DGE mode")
    if C.executing():
        if oob_mode == OOB.skip and not (src.on_chip and dst.on_chip):
            _copy_skipping_oob(dst, src)
        else:
            _copy_values(dst, src, op)
    side = dst if dst.on_chip else src
    parts = side.shape[0] if side.on_chip else 1
    nbytes = dst.size * max(D.itemsize(dst.dtype), D.itemsize(src.dtype))
    return C.emit("dma", op, src, dst, partitions=parts, free_elems=src.size // parts, dma_bytes=nbytes)


_TRANSPOSE_AXES = {2: ((1, 0),), 3: ((2, 1, 0),), 4: ((3, 1, 2, 0),)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=DGE.unknown, oob_mode=OOB.error, name=None):
    """DMA with a dimension permutation (gen3+, 2-byte dtypes, dst in SBUF, dst rank == src rank; §5.4)."""
    op = "dma_transpose"
    dst, src = C.tensor(dst, op, "dst"), C.tensor(src, op, "src")
    C.gen_at_least(3, op)
    dge_mode = require(dge_mode, DGE, op, "dge_mode")
    C.buffers(dst, ("sbuf",), op, "dst")
    C.buffers(src, ("hbm", "sbuf"), op, "src")
    if dst.ndim != src.ndim:
        raise SimulationError(f"{op} dst rank {dst.ndim} must equal src rank {src.ndim}")
    # default permutation per rank, as documented: 2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0)
    axes = tuple(axes) if axes is not None else _TRANSPOSE_AXES.get(src.ndim, ((),))[0]
    if axes not in _TRANSPOSE_AXES.get(src.ndim, ()):
        raise SimulationError(f"{op} axes {axes} not supported for rank {src.ndim}; allowed {_TRANSPOSE_AXES}")
    if dst.dtype != src.dtype or (dge_mode == DGE.hwdge and D.itemsize(src.dtype) != 2):
        raise SimulationError(f"{op} needs equal dtypes, 2-byte ones with dge_mode=hwdge (bf16/fp16/int16), got "
                              f"src {D.dtype_name(src.dtype)} dst {D.dtype_name(dst.dtype)}")
    want = tuple(src.shape[a] for a in axes)
    if dst.shape != want:
        raise SimulationError(f"{op} dst shape {dst.shape} must be the permuted src shape {want}")
    C.pdim(dst, op, "dst")
    C.writable(dst, op)
    if C.executing():
        C.store(dst, np.transpose(src.read(), axes))
    return C.emit("dma", op, src, dst, partitions=dst.shape[0], free_elems=C.free(dst),
                  dma_bytes=dst.size * D.itemsize(dst.dtype))


def tensor_copy(dst, src, engine=None, name=None):
    """On-chip copy with cast (bit-exact for equal dtypes); the usual PSUM -> SBUF eviction (§5.3)."""
    op = "tensor_copy"
    dst, src = C.tensor(dst, op, "dst"), C.tensor(src, op, "src")
    eng = C.engine_name(engine, "vector", op, ("vector", "scalar", "gpsimd"))
    for role, t in (("dst", dst), ("src", src)):
        C.buffers(t, ("sbuf", "psum") if eng != "gpsimd" else ("sbuf",), op, role)
    if eng == "scalar":
        C.gen_at_least(3, op, "on the scalar engine (use activation(op=nl.copy) on gen2)")
    C.same_partitions(op, dst=dst, src=src)
    C.same_free(op, dst=dst, src=src)
    C.writable(dst, op)
    if C.executing():
        if eng == "scalar":
            C.write(dst, C.read_f32(src))  # ScalarE always goes through fp32
        else:
            _copy_values(dst, src, op)
    return C.emit(eng, op, src, dst)


def memset(dst, value, engine=None, name=None):
    """Fill ``dst`` with ``value``; int dtypes need an integral value, x4 MX types only 0 (§5.3)."""
    op = "memset"
    dst = C.tensor(dst, op, "dst")
    eng = C.engine_name(engine, "vector", op, ("vector", "gpsimd", "scalar"))
    C.buffers(dst, ("sbuf", "psum") if eng != "gpsimd" else ("sbuf",), op, "dst")
    C.pdim(dst, op, "dst")
    C.writable(dst, op)
    if not isinstance(value, (bool, int, float, np.number)):
        raise SimulationError(f"{op} value must be a Python number, got {type(value).__name__}")
    if D.is_x4(dst.dtype) and value != 0:
        raise SimulationError(f"{op} on packed {D.dtype_name(dst.dtype)} supports only value 0")
    if D.is_int(dst.dtype) and (isinstance(value, float) and not float(value).is_integer()):
        raise SimulationError(f"{op} value {value!r} is a float but dst dtype {D.dtype_name(dst.dtype)} is an "
                              f"integer type; pass an int")
    if C.executing():
        if D.is_x4(dst.dtype):
            C.store(dst, np.zeros(dst.shape, dtype=dst.np_dtype))
        else:
            C.write(dst, np.full(dst.shape, value, dtype=np.float64 if D.is_int(dst.dtype) else np.float32))
    return C.emit(eng, op, dst, dst)


def affine_values(pattern, offset, channel_multiplier, parts: int, free: int, op: str) -> np.ndarray:
    """(P, F) int64 array ``offset + p*cm + sum_k idx_k*step_k`` (iota / affine_select, §5.3)."""
    pattern = [tuple(int(v) for v in pair) for pair in pattern]
    if not pattern or any(len(pair) != 2 for pair in pattern) or len(pattern) > 4:
        raise SimulationError(f"{op} pattern must be 1-4 [step, count] pairs, got {pattern}")
    counts = [c for _, c in pattern]
    if math.prod(counts) != free:
        raise SimulationError(f"{op} pattern {pattern} covers {math.prod(counts)} elements per partition but dst "
                              f"has {free}")
    vals = np.zeros(counts, dtype=np.int64)
    for k, (step, c) in enumerate(pattern):
        shape = [1] * len(counts)
        shape[k] = c
        vals = vals + (np.arange(c, dtype=np.int64) * step).reshape(shape)
    base = int(offset) + np.arange(parts, dtype=np.int64)[:, None] * int(channel_multiplier)
    return base + vals.reshape(1, -1)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd index generation: ``dst[p, i] = offset + p*cm + sum idx*step`` (int32, then cast; dst SBUF)."""
    op = "iota"
    dst = C.tensor(dst, op, "dst")
    C.buffers(dst, ("sbuf",), op, "dst")
    parts = C.pdim(dst, op, "dst")
    C.writable(dst, op)
    vals = affine_values(pattern, offset, channel_multiplier, parts, C.free(dst), op)
    if C.executing():
        v32 = vals.astype(np.int32)
        C.write(dst, v32 if D.is_int(dst.dtype) else v32.astype(np.float32))
    return C.emit("gpsimd", op, dst, dst)
