"""Further documented instructions: tensor_copy_predicated, dma_compute, max8, nc_find_index8, nc_match_replace8,
bn_stats, bn_aggr, nc_stream_shuffle, tensor_partition_reduce (NKI documentation)."""
from __future__ import annotations

import numpy as np

from . import alu
from . import checks as C
from . import dtypes as D
from .errors import SimulationError

_ALL_ONES = {D.uint32: 0xFFFFFFFF, D.uint16: 0xFFFF}


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst = where(pred != 0 (xor reverse), src, dst)``; src a tile or number; same dtype for tile src."""
    op = "tensor_copy_predicated"
    dst, pred = C.tensor(dst, op, "dst"), C.tensor(predicate, op, "predicate")
    for role, t in (("dst", dst), ("predicate", pred)):
        C.buffers(t, ("sbuf", "psum"), op, role)
    if pred.dtype not in (D.uint8, D.uint16, D.uint32):
        raise SimulationError(f"{op} predicate must be uint8/uint16/uint32, got {D.dtype_name(pred.dtype)}")
    parts = C.same_partitions(op, dst=dst, predicate=pred)
    C.same_free(op, dst=dst, predicate=pred)
    C.writable(dst, op)
    tile = isinstance(src, type(dst))
    if tile:
        C.buffers(src, ("sbuf", "psum"), op, "src")
        C.same_partitions(op, dst=dst, src=src)
        C.same_free(op, dst=dst, src=src)
        if src.dtype != dst.dtype:
            raise SimulationError(f"{op} src and dst must have the same dtype")
    elif not isinstance(src, (int, float, np.number)):
        raise SimulationError(f"{op} src must be a tile or a number")
    if C.executing():
        mask = (pred.read().reshape(parts, -1) != 0) ^ bool(reverse_pred)
        old = dst.read().reshape(parts, -1)
        new = src.read().reshape(parts, -1) if tile else C.cast_for(dst, np.full(old.shape, src, np.float32))
        C.store(dst, np.where(mask, new, old))
    return C.emit("vector", op, src if tile else dst, dst)


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=None, name=None):
    """``dst = sum(srcs)`` in fp32 through the DMA engines (only nl.add, scales 1.0, <= 16 sources; §5.4)."""
    op = "dma_compute"
    dst = C.tensor(dst, op, "dst")
    srcs = tuple(C.tensor(s, op, f"srcs[{i}]") for i, s in enumerate(srcs))
    if alu.get(reduce_op, f"{op} reduce_op").name != "add":
        raise SimulationError(f"{op} reduce_op must be nl.add")
    if not 1 <= len(srcs) <= 16:
        raise SimulationError(f"{op} takes 1..16 sources, got {len(srcs)}")
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise SimulationError(f"{op} scales must all be 1.0")
    for i, s in enumerate(srcs):
        C.buffers(s, ("hbm", "sbuf"), op, f"srcs[{i}]")
        if s.size != dst.size:
            raise SimulationError(f"{op} srcs[{i}] has {s.size} elements, dst {dst.size}")
    C.buffers(dst, ("hbm", "sbuf"), op, "dst")
    C.writable(dst, op)
    if C.executing():
        total = sum(C.read_f32(s).reshape(-1).astype(np.float32) for s in srcs)
        C.write(dst, total)
    parts = dst.shape[0] if dst.on_chip else 1
    nbytes = sum(s.size * D.itemsize(s.dtype) for s in srcs) + dst.size * D.itemsize(dst.dtype)
    return C.emit("dma", op, srcs[0], dst, partitions=parts, free_elems=dst.size // parts, dma_bytes=nbytes)


def max8(dst, src, name=None):
    """Top-8 values per partition in descending order (src 8..16384 elements per partition; dst [P, 8])."""
    op = "max8"
    dst, x = C.tensor(dst, op, "dst"), C.tensor(src, op, "src")
    parts = C.same_partitions(op, dst=dst, src=x)
    n = C.free(x)
    if not 8 <= n <= 16384 or x.ndim > 3:
        raise SimulationError(f"{op} src must hold 8..16384 elements per partition in <= 3 dims, got {x.shape}")
    if C.free(dst) != 8:
        raise SimulationError(f"{op} dst must be [{parts}, 8], got {dst.shape}")
    C.writable(dst, op)
    if C.executing():
        vals = C.read_2d(x)
        C.write(dst, -np.sort(-vals, axis=1)[:, :8])
    return C.emit("vector", op, x, dst)


def _occurrence_rank(vals: np.ndarray) -> np.ndarray:
    """rank[p, i] = number of j < i with vals[p, j] == vals[p, i] (duplicates map to successive occurrences)."""
    same = vals[:, :, None] == vals[:, None, :]                   # [P, 8, 8]
    return np.tril(same, k=-1).sum(axis=2)                        # count earlier equal entries


def _find(data: np.ndarray, vals: np.ndarray, rank: np.ndarray):
    """Index of the (rank+1)-th occurrence of each val in data ([P, F] vs [P, 8]); -1 when absent."""
    eq = data[:, None, :] == vals[:, :, None]                     # [P, 8, F]
    hit = eq & (np.cumsum(eq, axis=2) == (rank + 1)[:, :, None])
    found = hit.any(axis=2)
    return np.where(found, hit.argmax(axis=2), -1)


def nc_find_index8(dst, data, vals, name=None):
    """For each of 8 values per partition, the index of its first occurrence (duplicates: successive ones);
    unmatched -> all ones (0.6 fix). dst uint32 or uint16."""
    op = "nc_find_index8"
    dst, x, v = C.tensor(dst, op, "dst"), C.tensor(data, op, "data"), C.tensor(vals, op, "vals")
    if dst.dtype not in _ALL_ONES:
        raise SimulationError(f"{op} dst must be uint32 or uint16, got {D.dtype_name(dst.dtype)}")
    C.same_partitions(op, dst=dst, data=x, vals=v)
    if C.free(v) != 8 or C.free(dst) != 8:
        raise SimulationError(f"{op} vals and dst must hold 8 elements per partition")
    C.writable(dst, op)
    if C.executing():
        vv = C.read_2d(v)
        idx = _find(C.read_2d(x), vv, _occurrence_rank(vv))
        C.store(dst, np.where(idx < 0, _ALL_ONES[dst.dtype], idx).astype(dst.np_dtype))
    return C.emit("vector", op, x, dst)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Replace the first occurrence of each of 8 values with ``imm`` (duplicates processed i = 7..0)."""
    op = "nc_match_replace8"
    dst, x, v = C.tensor(dst, op, "dst"), C.tensor(data, op, "data"), C.tensor(vals, op, "vals")
    parts = C.same_partitions(op, dst=dst, data=x, vals=v)
    C.same_free(op, dst=dst, data=x)
    if C.free(v) != 8:
        raise SimulationError(f"{op} vals must hold 8 elements per partition")
    if dst_idx is not None and (C.free(dst_idx) != 8 or dst_idx.dtype not in _ALL_ONES):
        raise SimulationError(f"{op} dst_idx must be a uint32/uint16 [P, 8] tile")
    C.writable(dst, op)
    if C.executing():
        cur, vv = C.read_2d(x).copy(), C.read_2d(v)
        rows = np.arange(parts)
        idx = np.full((parts, 8), -1, dtype=np.int64)
        for i in range(7, -1, -1):            # fixed 8 steps, each vectorised over partitions
            eq = cur == vv[:, i:i + 1]
            found = eq.any(axis=1)
            first = eq.argmax(axis=1)
            cur[rows[found], first[found]] = np.float32(imm)
            idx[:, i] = np.where(found, first, -1)
        C.write(dst, cur)
        if dst_idx is not None:
            C.store(dst_idx, np.where(idx < 0, _ALL_ONES[dst_idx.dtype], idx).astype(dst_idx.np_dtype))
    return C.emit("vector", op, x, dst)


def bn_stats(dst, data, name=None):
    """Per partition (count, mean, var*count) of the even- and of the odd-indexed elements -> 6 values
    [count_e, mean_e, m2_e, count_o, mean_o, m2_o] (free size <= 512; layout UNCERTAIN, §5.3)."""
    op = "bn_stats"
    dst, x = C.tensor(dst, op, "dst"), C.tensor(data, op, "data")
    parts = C.same_partitions(op, dst=dst, data=x)
    if C.free(x) > 512:
        raise SimulationError(f"{op} free size {C.free(x)} exceeds bn_stats_fmax 512; split the data")
    if C.free(dst) != 6:
        raise SimulationError(f"{op} dst must hold 6 elements per partition, got {dst.shape}")
    C.writable(dst, op)
    if C.executing():
        vals = C.read_2d(x).astype(np.float64)
        out = []
        for half in (vals[:, 0::2], vals[:, 1::2]):
            n = half.shape[1]
            mean = half.mean(axis=1) if n else np.zeros(parts)
            out += [np.full(parts, n), mean, ((half - mean[:, None]) ** 2).sum(axis=1)]
        C.write(dst, np.stack(out, axis=1))
    return C.emit("vector", op, x, dst)


def bn_aggr(dst, data, name=None):
    """Combine k (count, mean, var*count) triples per partition into (mean, var) (Chan et al. merge)."""
    op = "bn_aggr"
    dst, x = C.tensor(dst, op, "dst"), C.tensor(data, op, "data")
    parts = C.same_partitions(op, dst=dst, data=x)
    if C.free(x) % 3 or C.free(dst) != 2:
        raise SimulationError(f"{op} data must hold k*3 values and dst 2 per partition, got {x.shape}, {dst.shape}")
    C.writable(dst, op)
    if C.executing():
        t = C.read_2d(x).astype(np.float64).reshape(parts, -1, 3)      # [P, k, (count, mean, m2)]
        cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
        total = cnt.sum(axis=1)
        mu = (cnt * mean).sum(axis=1) / total
        var = (m2 + cnt * (mean - mu[:, None]) ** 2).sum(axis=1) / total
        C.write(dst, np.stack([mu, var], axis=1))
    return C.emit("vector", op, x, dst)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant, dst partition i <- src partition mask[i]; 255 leaves dst unchanged.

    src and dst may cover different partition counts (e.g. one src partition broadcast to 32 dst partitions);
    active partitions = ceil(max(src, dst) / 32) * 32 fixes the legal start partitions of both (§5.3). A src that
    fits in one quadrant feeds every dst quadrant; otherwise dst quadrant q reads src quadrant q.
    """
    op = "nc_stream_shuffle"
    dst, x = C.tensor(dst, op, "dst"), C.tensor(src, op, "src")
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise SimulationError(f"{op} shuffle_mask must be 32 entries in 0..31 or 255")
    dparts, sparts = C.pdim(dst, op, "dst"), C.pdim(x, op, "src")
    C.same_free(op, dst=dst, src=x)
    if dst.dtype != x.dtype:
        raise SimulationError(f"{op} src and dst must have the same dtype")
    active = -(-max(dparts, sparts) // 32) * 32
    ok = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for role, t in (("dst", dst), ("src", x)):
        start = t.offset // t.partition_stride()
        if start not in ok:
            raise SimulationError(f"{op} {role} starts at partition {start}; with {active} active partitions the "
                                  f"start must be one of {ok}")
    C.writable(dst, op)
    if C.executing():
        out, inp = dst.read().reshape(dparts, -1).copy(), x.read().reshape(sparts, -1)
        for d in range(dparts):
            m = mask[d % 32]
            if m == 255:
                continue
            s = m if sparts <= 32 else (d // 32) * 32 + m
            if s >= sparts:
                raise SimulationError(f"{op} dst partition {d} reads src partition {s}, but src has {sparts}")
            out[d] = inp[s]
        C.store(dst, out)
    return C.emit("vector", op, x, dst, partitions=dparts)


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd reduction across partitions: dst [1, F] = reduce_p data[p, :] (add, maximum, minimum, bitwise)."""
    iname = "tensor_partition_reduce"
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o = alu.get(op, f"{iname} op")
    if o.name not in ("add", "maximum", "minimum", "bitwise_or", "bitwise_and"):
        raise SimulationError(f"{iname} op must be nl.add, nl.maximum, nl.minimum, nl.bitwise_or or nl.bitwise_and")
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf",), iname, role)
    C.pdim(x, iname, "data")
    if dst.shape[0] != 1 or C.free(dst) != C.free(x):
        raise SimulationError(f"{iname} dst must be [1, {C.free(x)}], got {dst.shape}")
    C.writable(dst, iname)
    if C.executing():
        vals = x.read().reshape(x.shape[0], -1) if o.is_bitvec else C.read_2d(x)
        C.write(dst, alu.REDUCERS[o.name][0].reduce(vals, axis=0)[None, :])
    return C.emit("gpsimd", iname, x, dst)
