"""NkiTensor: a view (offset + [[stride, count], ...] in element units) over a Storage (NKI documentation).

Reading a view gathers ``flat[offset + sum_k stride_k * i_k]`` with one broadcast index array; writing scatters
to the same indices. Views never copy.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from . import dtypes as D
from .errors import SimulationError


def _is_tensor_like(x) -> bool:
    return isinstance(x, NkiTensor)


class NkiTensor:
    """A view of an NKI tensor. Attributes mirror the real ``NkiTensor``: shape, strides, offset, dtype, buffer."""

    __slots__ = ("_idx", "dims", "dtype", "offset", "shape", "storage", "vector")

    def __init__(self, storage, dtype, offset: int, dims, vector=None):
        self.storage, self.dtype, self.offset = storage, dtype, int(offset)
        self.dims = tuple((int(s), int(c)) for s, c in dims)
        self.shape = tuple(c for _, c in self.dims)
        self._idx = None
        self.vector = vector   # (index tensor [P, 1], row stride): .ap(vector_offset=...) indirect rows on dim 0

    # ---- attributes -------------------------------------------------------------------------------------
    strides = property(lambda self: tuple(s for s, _ in self.dims))
    ndim = property(lambda self: len(self.dims))
    size = property(lambda self: math.prod(self.shape))
    buffer = property(lambda self: self.storage.buffer)
    name = property(lambda self: self.storage.name)
    on_chip = property(lambda self: self.storage.buffer.on_chip)
    kind = property(lambda self: self.storage.buffer.kind)

    def __repr__(self) -> str:
        return (f"NkiTensor(name={self.name!r}, shape={self.shape}, dtype={D.dtype_name(self.dtype)}, "
                f"buffer={self.buffer!r}, offset={self.offset}, strides={self.strides})")

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it with slices or loop over range(...)")

    # ---- element units -------------------------------------------------------------------------------------
    @property
    def np_dtype(self) -> np.ndarray:
        """NumPy dtype used to address the flat storage for this view."""
        st = self.storage
        if st.backing != D.storage_dtype(st.dtype):  # NKI_PRECISE_FP=0: low-precision data stored as fp32
            return st.backing
        return D.storage_dtype(self.dtype)

    def _limit(self) -> int:
        st = self.storage
        return st.elements * st.backing.itemsize // self.np_dtype.itemsize

    def _check_bounds(self) -> None:
        """The pattern must stay inside the storage; checked when the view is read or written (a view that is
        built but never accessed, e.g. a clamped tail computed ahead of a size test, is legal)."""
        if any(c < 0 for _, c in self.dims):
            raise SimulationError(f"tensor view {self.shape} of {self.name!r} has a negative dimension")
        if self.size == 0:
            return
        lo = self.offset + sum(min(0, s * (c - 1)) for s, c in self.dims)
        hi = self.offset + sum(max(0, s * (c - 1)) for s, c in self.dims)
        if lo < 0 or hi >= self._limit():
            raise SimulationError(f"access pattern {self.get_pattern()} offset {self.offset} reaches elements "
                                  f"[{lo}, {hi}] outside tensor {self.name!r} of {self._limit()} elements")

    def partition_stride(self) -> int:
        """Elements between partitions of the underlying on-chip allocation (in this view's units)."""
        st = self.storage
        return math.prod(st.shape[1:]) * st.backing.itemsize // self.np_dtype.itemsize

    # ---- data access -------------------------------------------------------------------------------------
    def index(self, oob_skip: bool = False) -> np.ndarray:
        """Flat element index of every view element. Indirect (vector_offset) views read their row indices now, as
        the DMA does when it runs; with ``oob_skip`` out-of-range rows get index -1 instead of raising."""
        if self.vector is not None:
            return self._indirect_index(oob_skip)
        if oob_skip:   # oob_mode.skip (e.g. a scalar_offset past the end): out-of-range rows are skipped
            return self._rows_in_range(self._pattern_index(self.dims, self.offset))
        if self._idx is None:
            self._check_bounds()
            self._idx = self._pattern_index(self.dims, self.offset)
        return self._idx

    def _pattern_index(self, dims, offset) -> np.ndarray:
        idx = np.full((1,) * len(dims), offset, dtype=np.int64)
        for k, (s, c) in enumerate(dims):
            shape = [1] * len(dims)
            shape[k] = c
            idx = idx + (np.arange(c, dtype=np.int64) * s).reshape(shape)
        return idx

    def _indirect_index(self, oob_skip: bool) -> np.ndarray:
        vec, row_stride = self.vector
        if vec.storage.raw is None:
            raise SimulationError("indirect (vector_offset) access needs tensor data (not available in cost-only mode)")
        rows = np.asarray(vec.read()).reshape(-1).astype(np.int64)          # [P] row numbers
        if rows.size != self.shape[0]:
            raise SimulationError(f"vector_offset holds {rows.size} indices but the pattern's first dim has "
                                  f"{self.shape[0]}")
        rest = self._pattern_index(((0, 1),) + self.dims[1:], self.offset)   # [1, F...]
        idx = rest + (rows * row_stride).reshape((-1,) + (1,) * (self.ndim - 1))
        if not oob_skip:
            bad = ((idx < 0) | (idx >= self._limit())).reshape(idx.shape[0], -1).any(axis=1)
            if bad.any():
                raise SimulationError(f"indirect access of {self.name!r}: vector_offset rows {rows[bad][:8].tolist()} "
                                      f"reach outside the tensor (use oob_mode=nisa.oob_mode.skip to skip them)")
        return self._rows_in_range(idx)

    def _rows_in_range(self, idx: np.ndarray) -> np.ndarray:
        """idx [P, F...] with every row (first-dim entry) that reaches outside the storage set to -1."""
        if idx.size == 0:
            return idx
        bad = ((idx < 0) | (idx >= self._limit())).reshape(idx.shape[0], -1).any(axis=1)
        return np.where(bad.reshape((-1,) + (1,) * (idx.ndim - 1)), -1, idx)

    def read(self) -> np.ndarray:
        """Gather the view's stored values (storage dtype) into an array of ``self.shape``."""
        if self.storage.raw is None:
            raise SimulationError("tensor data is not available in cost-only mode (execute=False)")
        return self.storage.typed(self.np_dtype)[self.index()]

    def write(self, values: np.ndarray) -> None:
        """Scatter already-cast values (any shape with the same element count) into the view."""
        if self.storage.raw is None and self.vector is not None:
            return
        idx = self.index()   # bounds are checked here, also in cost-only mode
        if self.storage.raw is None:
            return
        values = np.asarray(values, dtype=self.np_dtype)
        if values.size != self.size:
            raise SimulationError(f"internal: writing {values.size} elements into a view of {self.size}")
        self.storage.typed(self.np_dtype)[idx] = values.reshape(self.shape)

    # ---- indexing -------------------------------------------------------------------------------------------
    def __getitem__(self, key) -> NkiTensor:
        if self.vector is not None:
            raise SimulationError("an indirect (vector_offset) access pattern cannot be indexed further; build the "
                                  ".ap() with the final pattern")
        key = _normalise_key(key, self.ndim)
        offset, dims, kept, int_dims = self.offset, [], [], []
        for k, (item, (s, c)) in enumerate(zip(key, self.dims)):
            if isinstance(item, slice):
                start, count, step = _slice_range(item, c, k, self.shape)
                offset += start * s
                dims.append((s * step, count))
                kept.append(k)
            else:
                i = _int_index(item, c, k, self.shape)
                offset += i * s
                if self.on_chip and k == 0:   # on-chip: an integer on the partition dim keeps a size-1 dim
                    dims.append((s, 1))
                    kept.append(k)
                else:
                    int_dims.append((k, s))
        if self.on_chip and len(dims) < 2:     # on-chip results stay >= 2-D: keep the last dropped free dim
            k, s = int_dims[-1]
            dims.append((s, 1))
        if not dims:
            raise SimulationError(f"indexing {self.name!r} with {key} leaves no dimension; use a slice of size 1")
        return NkiTensor(self.storage, self.dtype, offset, dims)

    # ---- view methods (0.5+) ----------------------------------------------------------------------------------
    def get_pattern(self):
        return [[s, c] for s, c in self.dims]

    def is_contiguous(self) -> bool:
        dims = self.dims[1:] if self.on_chip else self.dims
        expect = 1
        for s, c in reversed(dims):
            if c != 1 and s != expect:
                return False
            expect *= c
        return True

    def ap(self, pattern, offset=0, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Raw access pattern over the underlying storage (not composable with the current view, §3.1).

        ``scalar_offset``: a register or one-element tensor; adds ``value * prod(self.shape[indirect_dim + 1:])``
        elements (the stride of dim ``indirect_dim`` of this tensor's shape, e.g. of a reshaped view).

        ``vector_offset``: a [P, 1] integer SBUF tensor; row i of the pattern's first dim starts at element
        ``offset + vector_offset[i] * prod(storage.shape[1:])`` (the row stride comes from the tensor's shape, not
        the pattern; HBM side of a DMA; ``indirect_dim=0`` only). The indices are read when the DMA runs."""
        dt = D.as_dtype(dtype) if dtype is not None else self.dtype
        base = NkiTensor.__new__(NkiTensor)
        base.storage, base.dtype, base.offset, base.dims, base._idx = self.storage, dt, 0, ((1, 1),), None
        base.shape = (1,)
        pattern = [tuple(int(v) for v in pair) for pair in pattern]
        if any(len(pair) != 2 for pair in pattern):
            raise SimulationError(f"ap pattern must be a list of [stride, count] pairs, got {pattern}")
        if self.on_chip and pattern[0][1] > 1 and pattern[0][0] != base.partition_stride():
            raise SimulationError(f"ap on on-chip tensor {self.name!r}: the first [stride, count] pair is the "
                                  f"partition dim and its stride must be {base.partition_stride()} (the allocation's "
                                  f"free size), got {pattern[0][0]}")
        if self.on_chip and getattr(scalar_offset, "dtype", None) == "int64":   # an nl.int64 NkiScalar
            raise SimulationError(f"ap on on-chip tensor {self.name!r}: an SBUF/PSUM scalar_offset must be an "
                                  "nl.int32 scalar (NKI 0.7 scalar_load reference)")
        start = int(offset) + _scalar_offset(scalar_offset, self.shape, indirect_dim)
        if vector_offset is None:
            return NkiTensor(self.storage, dt, start, pattern)
        if self.on_chip or indirect_dim != 0 or scalar_offset is not None:
            raise SimulationError("ap(vector_offset=...) addresses an HBM tensor with indirect_dim=0 and no "
                                  "scalar_offset")
        if not isinstance(vector_offset, NkiTensor) or not D.is_int(vector_offset.dtype):
            raise SimulationError("ap vector_offset must be an integer NKI tensor of shape [P, 1]")
        row = math.prod(self.storage.shape[1:]) * self.storage.backing.itemsize // D.storage_dtype(dt).itemsize
        return NkiTensor(self.storage, dt, start, pattern, vector=(vector_offset, row))

    def view(self, dtype) -> NkiTensor:
        """Bit reinterpretation; the last dim (contiguous) is rescaled by the itemsize ratio (§3.1)."""
        dt = D.as_dtype(dtype)
        old, new = self.np_dtype.itemsize, D.itemsize(dt)
        if self.storage.backing != D.storage_dtype(self.storage.dtype):
            raise SimulationError("view(dtype) reinterprets bits and needs NKI_PRECISE_FP=1")
        if old == new:
            return NkiTensor(self.storage, dt, self.offset, self.dims)
        s_last, c_last = self.dims[-1]
        if s_last != 1 and c_last != 1 or (c_last * old) % new:
            raise SimulationError(f"view({D.dtype_name(dt)}) needs a contiguous last dim whose byte size "
                                  f"({c_last}x{old} B) is a multiple of {new} B")
        scaled = [(s * old) for s, _ in self.dims[:-1]] + [self.offset * old]
        if any(v % new for v in scaled):
            raise SimulationError(f"view({D.dtype_name(dt)}): offset/strides are not aligned to {new} B")
        dims = [(s * old // new, c) for s, c in self.dims[:-1]] + [(1, c_last * old // new)]
        return NkiTensor(self.storage, dt, self.offset * old // new, dims)

    reinterpret_cast = view

    def reshape(self, shape) -> NkiTensor:
        shape = _resolve_shape(tuple(shape), self.size)
        if not self.is_contiguous():
            raise SimulationError(f"reshape of non-contiguous view {self.get_pattern()} of {self.name!r}")
        if self.on_chip:
            if shape[0] != self.shape[0]:
                raise SimulationError(f"reshape of an on-chip tensor must keep the partition dim {self.shape[0]}")
            return NkiTensor(self.storage, self.dtype, self.offset, [(self.dims[0][0], shape[0])] + _row_major(shape[1:]))
        return NkiTensor(self.storage, self.dtype, self.offset, _row_major(shape))

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        dim = _axis(dim, self.ndim)
        if self.dims[dim][1] != 1 or (self.on_chip and dim == 0):
            raise SimulationError(f"broadcast(dim={dim}) needs a size-1 free dim (shape {self.shape})")
        dims = list(self.dims)
        dims[dim] = (0, int(size))
        return NkiTensor(self.storage, self.dtype, self.offset, dims)

    def expand_dim(self, dim: int) -> NkiTensor:
        dims = list(self.dims)
        dims.insert(_axis(dim, self.ndim + 1), (0, 1))
        return NkiTensor(self.storage, self.dtype, self.offset, dims)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        dim = _axis(dim, self.ndim)
        if self.dims[dim][1] != 1:
            raise SimulationError(f"squeeze_dim({dim}) on a dim of size {self.dims[dim][1]}")
        return NkiTensor(self.storage, self.dtype, self.offset, self.dims[:dim] + self.dims[dim + 1:])

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[_axis(dim, self.ndim)] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: int) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[_axis(dim, self.ndim)] = index
        return self[tuple(key)]

    def permute(self, dims) -> NkiTensor:
        dims = [_axis(d, self.ndim) for d in dims]
        if sorted(dims) != list(range(self.ndim)) or (self.on_chip and dims[0] != 0):
            raise SimulationError(f"permute({dims}) must be a permutation (keeping dim 0 first on-chip)")
        return NkiTensor(self.storage, self.dtype, self.offset, [self.dims[d] for d in dims])


def _axis(dim: int, ndim: int) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise SimulationError(f"dimension {dim} out of range for a {ndim}-D tensor")
    return d


def _row_major(shape):
    dims, stride = [], 1
    for c in reversed(shape):
        dims.append((stride, c))
        stride *= c
    return dims[::-1]


def _resolve_shape(shape, size):
    if shape.count(-1) > 1:
        raise SimulationError(f"reshape {shape}: at most one -1")
    known = math.prod(c for c in shape if c != -1)
    if -1 in shape:
        shape = tuple(size // known if c == -1 else c for c in shape)
    if math.prod(shape) != size:
        raise SimulationError(f"reshape to {shape} changes the element count {size}")
    return shape


def _scalar_offset(value, base_shape, indirect_dim) -> int:
    """Elements a runtime ``scalar_offset`` adds: value * prod(base_shape[indirect_dim + 1:]), base_shape being the
    shape of the tensor ``ap`` is called on (a reshaped view scales by its own rows, not the allocation's)."""
    if value is None:
        return 0
    if hasattr(value, "value") and not isinstance(value, NkiTensor):   # a VirtualRegister or an NkiScalar
        if value.value is None:
            raise SimulationError("scalar_offset register read before it was written")
        value = value.value
    if isinstance(value, NkiTensor):
        if value.size != 1:
            raise SimulationError("scalar_offset tensor must hold exactly one element")
        value = int(np.asarray(value.read()).reshape(-1)[0])
    return int(value) * math.prod(base_shape[indirect_dim + 1:])


def _normalise_key(key, ndim):
    if not isinstance(key, tuple):
        key = (key,)
    if any(k is None for k in key):
        raise SimulationError("None/np.newaxis indexing is not supported on NkiTensor; use expand_dim")
    if sum(k is Ellipsis for k in key) > 1:
        raise SimulationError("an index may contain at most one Ellipsis")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (ndim - len(key) + 1) + key[i + 1:]
    if len(key) > ndim:
        raise SimulationError(f"too many indices ({len(key)}) for a {ndim}-D tensor")
    return key + (slice(None),) * (ndim - len(key))


def _as_int(value, k) -> int:
    try:
        return operator.index(value)
    except TypeError as exc:
        raise SimulationError(f"unsupported index {value!r} on dim {k}; use ints, slices or nl.ds") from exc


def _int_index(item, count, k, shape) -> int:
    i = _as_int(item, k)
    if i < 0:
        i += count
    if not 0 <= i < count:
        raise SimulationError(f"index {item} out of range for dim {k} of size {count} (shape {shape})")
    return i


def _slice_range(sl: slice, count, k, shape):
    step = 1 if sl.step is None else _as_int(sl.step, k)
    if step <= 0:
        raise SimulationError(f"slice step must be positive, got {step}")
    start = 0 if sl.start is None else _as_int(sl.start, k)
    stop = count if sl.stop is None else _as_int(sl.stop, k)
    start = start + count if start < 0 else start
    stop = stop + count if stop < 0 else stop
    if not (0 <= start <= stop <= count):
        raise SimulationError(f"slice [{sl.start}:{sl.stop}] is out of range for dim {k} of size "
                              f"{count} (shape {shape}); clamp it with min()")
    return start, len(range(start, stop, step)), step
