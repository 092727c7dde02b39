"""Scan, gather and compaction instructions: tensor_tensor_scan (VectorE), nc_n_gather, local_gather and
nonzero_with_count (GpSimd) — semantics as written in the NKI 0.6 API reference."""
from __future__ import annotations

import numpy as np

from . import alu
from . import checks as C
from . import dtypes as D
from .errors import SimulationError


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition: ``r[0] = op1(op0(d0[0], initial), d1[0])``, ``r[i] = op1(op0(d0[i], r[i-1]), d1[i])`` in fp32
    over the flattened free dims; ``reverse0``/``reverse1`` swap the operands of op0/op1."""
    iname = "tensor_tensor_scan"
    dst, a, b = C.tensor(dst, iname, "dst"), C.tensor(data0, iname, "data0"), C.tensor(data1, iname, "data1")
    o0, o1 = alu.get(op0, f"{iname} op0"), alu.get(op1, f"{iname} op1")
    for o in (o0, o1):
        if o.is_bitvec or not o.is_binary:
            raise SimulationError(f"{iname} op0/op1 must be binary arithmetic operators, got nl.{o.name}")
    for role, t in (("dst", dst), ("data0", a), ("data1", b)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    if a.kind == "psum" and b.kind == "psum":
        raise SimulationError(f"{iname} data0 and data1 cannot both be in PSUM")
    parts = C.same_partitions(iname, dst=dst, data0=a, data1=b)
    C.same_free(iname, dst=dst, data0=a, data1=b)
    C.writable(dst, iname)
    init = C.scalar_operand(initial, parts, iname, "initial")
    if C.executing():
        x0, x1 = C.read_2d(a), C.read_2d(b)                      # [P, F] fp32
        out = np.empty_like(x0)
        prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1, 1), (parts, 1))[:, 0]
        for i in range(x0.shape[1]):                               # sequential by definition
            s = o0.binary(prev, x0[:, i]) if reverse0 else o0.binary(x0[:, i], prev)
            prev = o1.binary(x1[:, i], s) if reverse1 else o1.binary(s, x1[:, i])
            out[:, i] = prev
        C.write(dst, out)
    return C.emit("vector", iname, a, dst)


def nc_n_gather(dst, data, indices, name=None):
    """``dst[p, j] = flat(data[p])[indices[p, j]]`` per partition (GpSimd; SBUF; uint32 indices; same dtype)."""
    iname = "nc_n_gather"
    dst, x, idx = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data"), C.tensor(indices, iname, "indices")
    for role, t in (("dst", dst), ("data", x), ("indices", idx)):
        C.buffers(t, ("sbuf",), iname, role)
    if idx.dtype != D.uint32:
        raise SimulationError(f"{iname} indices must be uint32, got {D.dtype_name(idx.dtype)}")
    if dst.dtype != x.dtype:
        raise SimulationError(f"{iname} dst dtype must equal data dtype ({D.dtype_name(x.dtype)})")
    parts = C.same_partitions(iname, dst=dst, data=x, indices=idx)
    C.same_free(iname, dst=dst, indices=idx)
    C.writable(dst, iname)
    if C.executing():
        table = x.read().reshape(parts, -1)
        where = idx.read().reshape(parts, -1).astype(np.int64)
        if where.size and (where.max() >= table.shape[1]):
            raise SimulationError(f"{iname} index {int(where.max())} out of range [0, {table.shape[1]})")
        C.store(dst, np.take_along_axis(table, where, axis=1))
    return C.emit("gpsimd", iname, x, dst)


_CORE_PARTS = 16   # partitions per GpSimd core


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per 16-partition GpSimd core: the core's uint16 ``index`` slice flattened partition-first gives element
    offsets into each partition's flattened free dims; every partition of the core gathers ``num_elem_per_idx``
    contiguous elements at each of the first ``num_valid_indices`` offsets (the reference's NumPy semantics):
    ``dst[p, i, e] = flat(src[p])[idx1d(core(p))[i] + e]``. Same dtype in and out; out-of-range offsets raise."""
    iname = "local_gather"
    dst, x, idx = C.tensor(dst, iname, "dst"), C.tensor(src_buffer, iname, "src_buffer"), C.tensor(index, iname,
                                                                                                     "index")
    for role, t in (("dst", dst), ("src_buffer", x), ("index", idx)):
        C.buffers(t, ("sbuf",), iname, role)
    if idx.dtype != D.uint16:
        raise SimulationError(f"{iname} index must be uint16, got {D.dtype_name(idx.dtype)}")
    if dst.dtype != x.dtype:
        raise SimulationError(f"{iname} dst dtype must equal src_buffer dtype ({D.dtype_name(x.dtype)})")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        raise SimulationError(f"{iname} num_elem_per_idx must be one of 1, 2, 4, 8, 16, 32; got {num_elem_per_idx}")
    parts = C.same_partitions(iname, dst=dst, src_buffer=x, index=idx)
    if parts % _CORE_PARTS:
        raise SimulationError(f"{iname} partition count must be a multiple of {_CORE_PARTS}, got {parts}")
    per_core = _CORE_PARTS * C.free(idx)
    n_valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < n_valid <= min(per_core, 4096):
        raise SimulationError(f"{iname} num_valid_indices must be in [1, {min(per_core, 4096)}], got {n_valid}")
    if C.free(dst) != n_valid * num_elem_per_idx:
        raise SimulationError(f"{iname} dst needs {n_valid * num_elem_per_idx} elements per partition, got "
                              f"{C.free(dst)}")
    C.writable(dst, iname)
    if C.executing():
        table = x.read().reshape(parts, -1)
        where = idx.read().reshape(parts, -1).astype(np.int64)
        out = np.empty((parts, n_valid * num_elem_per_idx), dtype=table.dtype)
        for p0 in range(0, parts, _CORE_PARTS):
            offs = where[p0:p0 + _CORE_PARTS].flatten(order="F")[:n_valid]
            cols = (offs[:, None] + np.arange(num_elem_per_idx)).reshape(-1)
            if cols.size and (cols.min() < 0 or cols.max() >= table.shape[1]):
                raise SimulationError(f"{iname} offset {int(cols.max())} outside [0, {table.shape[1]})")
            out[p0:p0 + _CORE_PARTS] = table[p0:p0 + _CORE_PARTS][:, cols]
        C.store(dst, out)
    return C.emit("gpsimd", iname, x, dst)


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """Partitions 0, 16, ..., 112 only: ``dst[p] = [indices of nonzeros + index_offset, padding..., count]``
    (gen3+; src fp32/int32 SBUF; dst int32 SBUF with one more element per partition)."""
    iname = "nonzero_with_count"
    C.gen_at_least(3, iname)
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(src, iname, "src")
    for role, t in (("dst", dst), ("src", x)):
        C.buffers(t, ("sbuf",), iname, role)
    if x.dtype not in (D.float32, D.int32) or dst.dtype != D.int32:
        raise SimulationError(f"{iname} src must be float32/int32 and dst int32, got {D.dtype_name(x.dtype)} and "
                              f"{D.dtype_name(dst.dtype)}")
    parts = C.same_partitions(iname, dst=dst, src=x)
    n = C.free(x)
    if C.free(dst) != n + 1:
        raise SimulationError(f"{iname} dst needs {n + 1} elements per partition (src has {n}), got {C.free(dst)}")
    C.writable(dst, iname)
    if C.executing():
        vals, out = x.read().reshape(parts, n), dst.read().reshape(parts, n + 1).copy()
        for p in range(0, parts, 16):            # one GpSimd core per 16 partitions reads its first partition
            hits = np.nonzero(vals[p])[0]
            out[p, :n] = int(padding_val)
            out[p, :hits.size] = hits + int(index_offset)
            out[p, n] = hits.size
        C.store(dst, out.astype(np.int32))
    return C.emit("gpsimd", iname, x, dst)
