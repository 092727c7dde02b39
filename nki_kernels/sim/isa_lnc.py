"""Cross-core instructions of an LNC2 launch: sendrecv and core_barrier (NKI 0.6 API reference; gen3+).

The two program instances run concurrently (launch.py); these instructions meet through ``Shared.mailbox`` /
``Shared.arrivals`` under ``Shared.cond``. Calls are matched by order: the n-th ``sendrecv`` on a ``pipe_id`` of one
core pairs with the n-th on the same pipe of the other core; the n-th ``core_barrier`` with the other's n-th.
"""
from __future__ import annotations

import numpy as np

from . import checks as C
from . import runtime
from .enums import dma_engine as DMAE
from .enums import engine as ENG
from .enums import require
from .errors import SimulationError

_GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}   # max bytes per partition with dma_engine.gpsimd_dma


def _lnc2(op: str):
    ctx = runtime.current()
    C.gen_at_least(3, op)
    if ctx.num_programs != 2:
        raise SimulationError(f"{op} exchanges data between the two cores of an LNC2 launch (kernel[2]); this "
                              f"launch has {ctx.num_programs} program(s)")
    return ctx


def _next_seq(ctx, key) -> int:
    n = ctx.sync_seq.get(key, 0)
    ctx.sync_seq[key] = n + 1
    return n


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=DMAE.dma, name=None):
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving core ``recv_from_rank``'s ``src`` here."""
    op = "sendrecv"
    src, dst = C.tensor(src, op, "src"), C.tensor(dst, op, "dst")
    eng = require(dma_engine, DMAE, op, "dma_engine")
    ctx = _lnc2(op)
    for role, t in (("src", src), ("dst", dst)):
        C.buffers(t, ("sbuf",), op, role)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise SimulationError(f"{op} src and dst must have the same dtype and shape, got {src.shape} "
                              f"{src.dtype} and {dst.shape} {dst.dtype}")
    C.same_partitions(op, src=src, dst=dst)
    for role, rank in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if rank not in (0, 1):
            raise SimulationError(f"{op} {role} must be 0 or 1, got {rank!r}")
    if eng == DMAE.gpsimd_dma:
        size = src.dtype.itemsize if hasattr(src.dtype, "itemsize") else 4
        limit = _GPSIMD_DMA_BYTES.get(size, 1024)
        if C.free(src) * size > limit:
            raise SimulationError(f"{op} with dma_engine.gpsimd_dma moves at most {limit} B per partition for "
                                  f"{size}-byte types, got {C.free(src) * size}")
    C.writable(dst, op)
    me, shared = ctx.program_id, ctx.shared
    seq = _next_seq(ctx, ("sendrecv", pipe_id))
    payload = src.read().copy() if ctx.execute else None
    with shared.cond:
        shared.mailbox[(pipe_id, seq, me, int(send_to_rank))] = payload
        shared.cond.notify_all()
        key = (pipe_id, seq, int(recv_from_rank), me)
        got = runtime.wait_for(ctx, lambda: (shared.mailbox[key],) if key in shared.mailbox else None,
                               f"{op}(pipe_id={pipe_id}) waiting for core {recv_from_rank}")
        del shared.mailbox[key]
    if ctx.execute:
        C.store(dst, np.asarray(got[0]).reshape(dst.shape))
    return C.emit("dma", op, src, dst, dma_bytes=src.size * src.np_dtype.itemsize)


def core_barrier(data, cores, engine=ENG.gpsimd, name=None):
    """Both cores wait here until both arrived; ``data`` is the shared HBM tensor they synchronise on."""
    op = "core_barrier"
    data = C.tensor(data, op, "data")
    ctx = _lnc2(op)
    if tuple(cores) != (0, 1):
        raise SimulationError(f"{op} cores must be (0, 1), got {cores!r}")
    if data.kind != "hbm" or data.buffer.name != "shared_hbm":
        raise SimulationError(f"{op} data must be a shared HBM tensor, got {data.buffer!r}")
    C.engine_name(engine, "gpsimd", op, ("gpsimd", "vector", "scalar", "tensor", "sync"))
    shared = ctx.shared
    seq = _next_seq(ctx, ("barrier",))
    with shared.cond:
        shared.arrivals[seq] = shared.arrivals.get(seq, 0) + 1
        shared.cond.notify_all()
        runtime.wait_for(ctx, lambda: True if shared.arrivals.get(seq, 0) >= 2 else None,
                         f"{op} #{seq} waiting for the other core")
    return C.emit("gpsimd", op, data, None, partitions=1, free_elems=1)
