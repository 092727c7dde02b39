"""Shared validation, operand reading and event helpers for the instruction modules (NKI documentation)."""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as D
from . import runtime
from .errors import SimulationError
from .events import InstrEvent
from .tensor import NkiTensor


class NkiInstruction:
    """Handle returned by every ``nisa`` call (scheduling hints are accepted and ignored)."""

    def __init__(self, op: str):
        self.op = op

    def depends_on(self, *producers) -> NkiInstruction:
        return self


def tensor(x, op: str, role: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise SimulationError(f"{op} {role} must be an NKI tensor, got {type(x).__name__}")
    return x


def pdim(t: NkiTensor, op: str, role: str) -> int:
    """Partition count of an on-chip operand (checked <= 128 and contiguous; §2.4)."""
    p = t.shape[0]
    if t.on_chip and p > 128:
        raise SimulationError(f"{op} {role} partition dimension {p} exceeds maximum 128")
    if t.on_chip and p > 1 and t.dims[0][0] != t.partition_stride():
        raise SimulationError(f"{op} {role} accesses partitions with a step; an SBUF/PSUM access must cover a "
                              f"contiguous range of partitions (slice dim 0 without a step)")
    return p


def free(t: NkiTensor) -> int:
    return math.prod(t.shape[1:]) if t.ndim > 1 else 1


def buffers(t: NkiTensor, allowed: tuple[str, ...], op: str, role: str) -> None:
    if t.kind not in allowed:
        raise SimulationError(f"{op} {role} must be in {' or '.join(a.upper() for a in allowed)}, "
                              f"but {t.name or 'the tensor'!r} is in {t.kind.upper()}")


def writable(dst: NkiTensor, op: str) -> None:
    """Any view may be written, including stride-0 (broadcast) ones: elements that map to the same address are
    written in order, so the last one wins (NumPy scatter semantics, as the hardware's sequential write stream)."""
    tensor(dst, op, "dst")


def same_partitions(op: str, **tensors) -> int:
    parts = {role: pdim(t, op, role) for role, t in tensors.items() if t is not None}
    if len(set(parts.values())) > 1:
        raise SimulationError(f"{op} partition dimensions differ: {parts}")
    return next(iter(parts.values()))


def same_free(op: str, **tensors) -> int:
    sizes = {role: free(t) for role, t in tensors.items() if t is not None}
    if len(set(sizes.values())) > 1:
        raise SimulationError(f"{op} elements per partition differ: {sizes}")
    return next(iter(sizes.values()))


def gen_at_least(gen: int, op: str, what: str = "") -> None:
    ctx = runtime.current()
    if ctx.gen < gen:
        raise SimulationError(f"{op}{' ' + what if what else ''} requires NeuronCore gen{gen}+ "
                              f"({'trn2' if gen == 3 else 'trn3'}); target is {ctx.target.name}")


def engine_name(engine, default: str, op: str, allowed: tuple[str, ...]) -> str:
    """Resolve an ``engine=`` argument (nisa.engine.* / legacy aliases) to an engine name."""
    name = getattr(engine, "name", engine)
    if name in (None, "unknown"):
        return default
    if name not in allowed:
        raise SimulationError(f"{op} cannot run on the {name} engine; allowed: {', '.join(allowed)}")
    return name


def read_f32(t: NkiTensor) -> np.ndarray:
    return D.to_f32(t.read(), t.dtype)


def read_2d(t: NkiTensor) -> np.ndarray:
    """(P, F) fp32 view of an operand's values, free dims flattened."""
    return read_f32(t).reshape(t.shape[0], -1)


def cast_for(dst: NkiTensor, values: np.ndarray) -> np.ndarray:
    """fp32 results -> dst's storage values (no rounding when NKI_PRECISE_FP=0 holds low precision in fp32)."""
    if dst.np_dtype != D.storage_dtype(dst.dtype):
        return np.asarray(values, dtype=np.float32)
    return D.cast(values, dst.dtype)


def write(dst: NkiTensor, values: np.ndarray) -> None:
    """Cast fp32 results to dst's dtype and store them (A.3 steps 3-4)."""
    store(dst, cast_for(dst, values))


def store(dst: NkiTensor, stored: np.ndarray, by_matmul: bool = False) -> None:
    """Write values already in dst's storage dtype; track which PSUM elements a matmul wrote (A.3 accumulate)."""
    dst.write(stored)
    if dst.kind == "psum" and (by_matmul or dst.storage.written is not None):
        dst.storage.matmul_bits()[dst.index().reshape(-1)] = by_matmul


def scalar_operand(x, parts: int, op: str, role: str, integer: bool = False):
    """A Python number or a (P, 1) tile broadcast along the free dims -> fp32 array of shape (P, 1)."""
    if isinstance(x, NkiTensor):
        if x.shape[0] != parts or free(x) != 1:
            raise SimulationError(f"{op} {role} must be a scalar or a ({parts}, 1) tile, got shape {x.shape}")
        if not runtime.current().execute:
            return None
        v = x.read().reshape(parts, 1)
        return v if integer else D.to_f32(v, x.dtype)
    if isinstance(x, (bool, int, float, np.number)):
        return np.array(x) if integer else np.float32(x)
    raise SimulationError(f"{op} {role} must be a number or a (P, 1) tile, got {type(x).__name__}")


def buf(t) -> str:
    return t.kind if isinstance(t, NkiTensor) else ""


def emit(engine: str, op: str, main: NkiTensor, dst: NkiTensor | None, **extra) -> NkiInstruction:
    """Record one instruction event (one per instruction; nki_kernels/sim/events.py)."""
    parts = main.shape[0] if main.on_chip or dst is None else dst.shape[0]
    out = dst if dst is not None else main
    ev = InstrEvent(engine=engine, op=op, partitions=int(extra.pop("partitions", parts)),
                    free_elems=int(extra.pop("free_elems", free(main))),
                    in_dtype=D.dtype_name(main.dtype), out_dtype=D.dtype_name(out.dtype),
                    src_buffer=buf(main), dst_buffer=buf(dst), **extra)
    runtime.emit(ev)
    return NkiInstruction(op)


def executing() -> bool:
    return runtime.current().execute
