"""Buffers, storages and live on-chip allocation accounting (NKI documentation).

Lifetime rule (simulator choice, see FIDELITY.md): an SBUF/PSUM allocation is live from ``nl.ndarray`` until the
last Python reference to its storage (through any view) disappears; CPython refcounting frees it at once, so a
tile allocated in a loop body is released when the next iteration rebinds the name (after the new one is
allocated, which is how a double-buffered loop body behaves). Everything is released when the kernel returns.
"""
from __future__ import annotations

import math
import warnings
import weakref

import numpy as np

from . import dtypes as D
from .errors import CapacityError, SimulationError, SimulatorWarning


class MemoryRegion:
    """A memory region: ``nl.sbuf``, ``nl.psum``, ``nl.hbm``/``nl.private_hbm``, ``nl.shared_hbm``.

    ``equals``: names of the regions this one compares equal to. Kernel arguments live in ``KERNEL_ARG_HBM``, which is
    shared HBM (visible to both LNC2 cores) and compares equal to ``nl.shared_hbm`` and to ``nl.hbm`` (the SDK's
    MXFP deep-dive kernels assert ``input.buffer == nl.hbm``; nki-library accepts either).
    """

    def __init__(self, name: str, kind: str, equals: tuple[str, ...] = ()):
        self.name = name
        self.kind = kind  # "sbuf" | "psum" | "hbm"
        self.equals = frozenset((name,) + equals)

    @property
    def on_chip(self) -> bool:
        return self.kind in ("sbuf", "psum")

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryRegion):
            return NotImplemented
        return self.name in other.equals or other.name in self.equals

    def __hash__(self) -> int:
        return hash(self.kind)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf = MemoryRegion("sbuf", "sbuf")
psum = MemoryRegion("psum", "psum")
private_hbm = MemoryRegion("private_hbm", "hbm")
hbm = private_hbm  # alias of private_hbm (0.3+ docs, §2.1)
shared_hbm = MemoryRegion("shared_hbm", "hbm")
KERNEL_ARG_HBM = MemoryRegion("shared_hbm", "hbm", equals=("private_hbm",))


class Storage:
    """One allocation: a flat byte array (or ``None`` in cost-only mode) plus its allocation shape and dtype.

    ``dtype`` is the logical element type; with NKI_PRECISE_FP=0, bf16/fp16/fp8 storages hold fp32 instead
    (``backing`` is then float32).
    """

    __slots__ = ("__weakref__", "backing", "buffer", "dtype", "name", "raw", "shape", "written")

    def __init__(self, name, buffer, shape, dtype, backing, raw):
        self.name, self.buffer, self.shape, self.dtype = name, buffer, tuple(shape), dtype
        self.backing = backing     # np dtype of stored elements
        self.raw = raw             # 1-D uint8 array, or None (cost-only)
        self.written = None        # PSUM: per-element "written by a matmul" bits (A.3)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    def typed(self, np_dtype) -> np.ndarray:
        """The whole storage as a flat array of ``np_dtype`` (shares memory)."""
        return self.raw.view(np_dtype)

    def matmul_bits(self) -> np.ndarray:
        if self.written is None:
            self.written = np.zeros(self.elements, dtype=bool)
        return self.written


def fill_value(dt):
    """Fresh tensors: NaN for floats, 4 for integers (real simulator, §7.1); packed x4 words are all-NaN bytes."""
    return np.nan if D.is_float(dt) else 4


class Allocator:
    """Live-bytes accounting for one on-chip memory of one program instance."""

    def __init__(self, kind: str, capacity: int, unit: int = 1):
        self.kind, self.capacity, self.unit = kind, capacity, unit
        self.used = 0
        self.live: dict[int, tuple[str, int]] = {}
        self._next = 0

    def allocate(self, storage: Storage, bytes_per_partition: int) -> None:
        cost = self._units(bytes_per_partition)
        if cost > self.capacity:   # cannot fit even alone: invalid on any allocator
            raise CapacityError(self._overflow_message(storage, bytes_per_partition, cost))
        if self.used + cost > self.capacity:
            # The compiler allocates by liveness (last use); the simulator only knows reachability, so tiles a
            # kernel keeps in lists but no longer uses still count here. Over-subscription is therefore reported,
            # not refused (tests of our own kernels turn SimulatorWarning into an error).
            warnings.warn(self._overflow_message(storage, bytes_per_partition, cost), SimulatorWarning, stacklevel=4)
        self._next += 1
        key = self._next
        self.live[key] = (storage.name, cost)
        self.used += cost
        weakref.finalize(storage, self._free, key)

    def _units(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.unit) * self.unit if self.unit > 1 else nbytes

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.used -= entry[1]

    def _overflow_message(self, storage, nbytes, cost) -> str:
        top = sorted(self.live.values(), key=lambda e: -e[1])[:6]
        live = ", ".join(f"{n or '<unnamed>'}={c}B" for n, c in top)
        if len(self.live) > len(top):
            live += f" and {len(self.live) - len(top)} more"
        what = f"{self.kind.upper()} allocation {storage.name or '<unnamed>'!r} {storage.shape} {D.dtype_name(storage.dtype)}"
        unit = f" ({cost // self.unit} bank(s) of {self.unit} B)" if self.unit > 1 else ""
        return (f"{what} needs {nbytes} B per partition{unit}, but only {self.capacity - self.used} of "
                f"{self.capacity} B per partition are free; live allocations: {live or 'none'}. Reduce tile "
                f"sizes or let earlier tiles go out of scope (allocate inside the loop body).")


def new_storage(name, buffer, shape, dtype, precise_fp: bool, execute: bool, fill=True) -> Storage:
    """Allocate a storage (bytes padded to a multiple of 4 so any dtype view fits), filled like the simulator."""
    backing = D.storage_dtype(dtype)
    if not precise_fp and dtype in D.LOW_PRECISION:
        backing = np.dtype(np.float32)
    count = math.prod(shape)
    raw = None
    if execute:
        nbytes = count * backing.itemsize
        raw = np.empty(nbytes + (-nbytes) % 4, dtype=np.uint8)
        if fill:
            _fill(raw[:nbytes].view(backing), dtype)
    if not isinstance(buffer, MemoryRegion):
        raise SimulationError(f"buffer must be an nl buffer object (nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm), got {buffer!r}")
    return Storage(name, buffer, shape, dtype, backing, raw)


def _fill(arr: np.ndarray, dtype) -> None:
    if D.is_x4(dtype):
        arr[...] = np.iinfo(arr.dtype).max  # all-ones bytes: NaN for fp8 x4 elements, -6 for fp4 (no NaN)
    elif arr.dtype.kind == "f" or dtype in D.LOW_PRECISION or dtype == D.tfloat32:
        arr[...] = np.nan
    else:
        arr[...] = 4 if arr.dtype.kind != "b" else True
