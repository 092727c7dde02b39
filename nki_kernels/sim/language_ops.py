"""``nki.language`` functions: allocation, SPMD queries, loops and the experimental convenience wrappers
(nl.load/store/copy/matmul/transpose, element-wise ops, reductions) that allocate their result and lower to
``nisa`` instructions (NKI documentation)."""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import math
import os
import sys

import numpy as np

from . import alu, isa_data, isa_scalar, isa_tensor, isa_vector, runtime
from . import checks as C
from . import dtypes as D
from . import memory as M
from .errors import SimulationError
from .tensor import NkiTensor, _row_major

_SIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _call_site() -> str:
    """``file.py:line`` of the kernel code that called into the simulator (names unnamed allocations)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SIM_DIR):
        frame = frame.f_back
    return "" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def ndarray(shape, dtype, buffer=M.sbuf, name="", address=None):
    """Allocate an uninitialised tensor (NaN / 4 filled) in ``buffer`` (§2.5)."""
    ctx = runtime.current()
    if isinstance(buffer, str):
        raise SimulationError(f"buffer must be an object such as nl.sbuf, not the string {buffer!r}")
    if not isinstance(buffer, M.MemoryRegion):
        raise SimulationError(f"buffer must be nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or nl.shared_hbm, got {buffer!r}")
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if not shape or any(s <= 0 for s in shape):
        raise SimulationError(f"tensor shape {shape} must have positive sizes")
    dt = D.as_dtype(dtype)
    label = name or f"{buffer.name}@{_call_site()}"
    if buffer.on_chip and len(shape) < 2:
        raise SimulationError(f"on-chip tensor {label!r} needs >= 2 dims (partition, free...), got {shape}")
    if buffer is M.psum and address is not None and int(address[1]) % ctx.target.psum_bank_bytes:
        raise SimulationError(f"PSUM tensor {label!r} address {address} must start at a bank boundary "
                              f"(multiple of {ctx.target.psum_bank_bytes} B)")
    storage = _shared_or_new(ctx, label, buffer, shape, dt)
    if buffer.on_chip and address is None:   # address=: placed by the kernel author inside memory it manages
        alloc = ctx.sbuf if buffer is M.sbuf else ctx.psum
        alloc.allocate(storage, math.prod(shape[1:]) * D.itemsize(dt))
    return NkiTensor(storage, dt, 0, _row_major(shape))


def _shared_or_new(ctx, label, buffer, shape, dt):
    """LNC2: the k-th shared_hbm allocation of every program instance is the same tensor (§3.4)."""
    if buffer.name != "shared_hbm":
        return M.new_storage(label, buffer, shape, dt, ctx.precise_fp, ctx.execute)
    k = ctx.shared_index
    ctx.shared_index += 1
    with ctx.shared.cond:   # LNC2 programs run concurrently: the first to reach allocation k creates it
        if k < len(ctx.shared.storages):
            st = ctx.shared.storages[k]
            if st.shape != shape or st.dtype != dt:
                raise SimulationError(f"program {ctx.program_id} allocates shared_hbm {label!r} {shape} but the "
                                      f"other program allocated {st.shape} at the same point; control flow must "
                                      f"match across cores")
            return st
        st = M.new_storage(label, buffer, shape, dt, ctx.precise_fp, ctx.execute)
        ctx.shared.storages.append(st)
        return st


def full(shape, fill_value, dtype, buffer=M.sbuf, name=""):
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    if buffer.on_chip:
        isa_data.memset(t, fill_value)
    elif C.executing():
        C.write(t, np.full(t.shape, fill_value, dtype=np.float64))
    return t


def zeros(shape, dtype, buffer=M.sbuf, name=""):
    return full(shape, 0, dtype, buffer=buffer, name=name)


def ones(shape, dtype, buffer=M.sbuf, name=""):
    return full(shape, 1, dtype, buffer=buffer, name=name)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def shared_identity_matrix(n, dtype=D.uint8, dst=None):
    """An (n, n) identity in SBUF (a constant the compiler DMAs in from HBM), or written into ``dst``."""
    if dst is not None:
        t = C.tensor(dst, "shared_identity_matrix", "dst")
        if tuple(t.shape) != (n, n):
            raise SimulationError(f"shared_identity_matrix dst must have shape ({n}, {n}), got {t.shape}")
    else:
        t = ndarray((n, n), dtype, buffer=M.sbuf, name=f"identity_{n}_{D.dtype_name(D.as_dtype(dtype))}")
    if C.executing():
        C.write(t, np.eye(n, dtype=np.float32))
    C.emit("dma", "dma_copy", t, t, dma_bytes=t.size * D.itemsize(t.dtype))
    return t


def shared_constant(constant):
    """A shared_hbm constant from a NumPy array or the path of a ``.npy`` file (§2.1)."""
    if isinstance(constant, (str, os.PathLike)):
        if not str(constant).endswith(".npy"):
            raise SimulationError(f"nl.shared_constant path must name a .npy file, got {constant!r}")
        constant = np.load(constant, allow_pickle=False)
    arr = np.asarray(constant)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif arr.dtype == np.int64:
        arr = arr.astype(np.int32)
    t = ndarray(arr.shape, arr.dtype, buffer=M.shared_hbm, name="shared_constant")
    if C.executing():
        C.write(t, arr.astype(np.float64) if D.is_int(t.dtype) else arr.astype(np.float32))
    return t


# ---- SPMD / loops ----------------------------------------------------------------------------------------------
def program_id(axis=0):
    ctx = runtime.current()
    if axis != 0:
        raise SimulationError(f"program_id(axis={axis}): the new API launches a 1-D grid kernel[lnc]; use axis=0")
    return ctx.program_id


def num_programs(axes=0):
    if axes not in (0, None):
        raise SimulationError(f"num_programs(axes={axes}): only axis 0 exists in kernel[lnc] launches")
    return runtime.current().num_programs


def program_ndim():
    return runtime.current().program_ndim


def affine_range(start, stop=None, step=1):
    """Compile-time loop: an alias of Python ``range`` (§3.3); deprecated in NKI 0.7, where it still is ``range``."""
    return range(start) if stop is None else range(start, stop, step)


sequential_range = static_range = affine_range


def _bound(x, what: str) -> int:
    """A loop bound: a Python int, a ``VirtualRegister`` or (0.7) an int32 ``NkiScalar`` (64-bit bounds have no
    compare-and-branch form: rejected)."""
    if getattr(x, "dtype", None) == "int64":
        raise SimulationError(f"nl.fori_loop {what} must be 32-bit; an nl.int64 NkiScalar cannot bound a loop")
    value = getattr(x, "value", x)
    if value is None:
        raise SimulationError(f"nl.fori_loop {what}: register read before it was written")
    return int(value)


def fori_loop(lower, upper, body_fun, step=1):
    """Runtime counted loop (0.6+, §3.3); simulated as a Python loop. Not allowed inside ``nl.no_reorder()``.

    The body's value: under the 0.7 rules an ``NkiScalar``, or a ``VirtualRegister`` when a bound is one (2.33 API
    reference); under the 0.6 rules a ``VirtualRegister``; with both APIs accepted, a Python int."""
    from .api_version import api_version
    from .isa_registers import VirtualRegister
    from .nki_scalar import NkiScalar

    if runtime.current().no_reorder_depth:
        raise SimulationError("nl.fori_loop is not allowed inside a nl.no_reorder() block")
    if not isinstance(step, int) or step <= 0:
        raise SimulationError(f"nl.fori_loop step must be a compile-time positive integer, got {step!r}")
    version = api_version()
    register = version == "0.6" or isinstance(lower, VirtualRegister) or isinstance(upper, VirtualRegister)
    for i in range(_bound(lower, "lower"), _bound(upper, "upper"), step):
        if version is None:
            body_fun(i)
        else:
            body_fun(VirtualRegister(i) if register else NkiScalar(i, "int32"))


def device_print(print_prefix, tensor):
    if C.executing():
        print(print_prefix, tensor.read())


@contextlib.contextmanager
def no_reorder():
    """Forbids compiler reordering inside the block (no effect on the in-order simulator)."""
    ctx = runtime.current()
    ctx.no_reorder_depth += 1
    try:
        yield
    finally:
        ctx.no_reorder_depth -= 1


class _NKIObjectType(type):
    """``@dataclass`` subclasses built with keywords follow NKIObject(**kwargs) (each keyword becomes an attribute):
    keywords may name attributes declared without annotation (``section_idx = None``: not a dataclass field), and a
    field without default that is not given stays unset (reading it raises AttributeError), as nki-library's
    kernels rely on. Keywords naming nothing declared still raise TypeError."""

    def __call__(cls, *args, **kwargs):
        if not dataclasses.is_dataclass(cls):
            return super().__call__(*args, **kwargs)
        init = cls.__init__
        if getattr(getattr(init, "__code__", None), "co_filename", "") != "<string>":   # a hand-written __init__
            return super().__call__(*args, **kwargs)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        names = {f.name for f in fields}
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in names and hasattr(cls, k)}
        missing = [f for f in fields if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if args or not missing:
            obj = super().__call__(*args, **kwargs)
        else:
            unknown = set(kwargs) - names
            if unknown:
                raise TypeError(f"{cls.__name__}() got unexpected keyword arguments {sorted(unknown)}")
            obj = cls.__new__(cls)
            for f in fields:
                if f.name in kwargs:
                    object.__setattr__(obj, f.name, kwargs[f.name])
                elif f.default_factory is not dataclasses.MISSING:
                    object.__setattr__(obj, f.name, f.default_factory())
                elif f.default is not dataclasses.MISSING:
                    object.__setattr__(obj, f.name, f.default)
            if hasattr(obj, "__post_init__"):
                obj.__post_init__()
        for key, value in extra.items():
            object.__setattr__(obj, key, value)
        return obj


class NKIObject(metaclass=_NKIObjectType):
    """Base class for NKI kernel dataclasses and configuration objects (§1.3): ``NKIObject(**fields)`` sets each
    keyword as an attribute; ``@dataclass`` subclasses keep their generated constructor (and accept keywords for
    attributes declared without annotation)."""

    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)


def ds(start, size):
    """``nl.ds(start, size)`` == ``start:start+size`` (§3.1)."""
    return slice(start, start + size)


def random_seed(seed):
    """Seed ``nl.rand`` from a [1, 1] SBUF/PSUM tensor holding a 32-bit value (same seed -> same sequence)."""
    t = C.tensor(seed, "random_seed", "seed")
    C.buffers(t, ("sbuf", "psum"), "random_seed", "seed")
    if t.size != 1:
        raise SimulationError(f"random_seed needs a [1, 1] tensor, got {t.shape}")
    ctx = runtime.current()
    if ctx.execute:
        ctx.rng = np.random.default_rng(int(np.asarray(t.read()).reshape(-1)[0]) & 0xFFFFFFFF)


def rand(shape, dtype, buffer=M.sbuf, name=""):
    """A new tensor of uniform [0, 1) values (the generator is NumPy's, not the hardware's)."""
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    ctx = runtime.current()
    if ctx.execute:
        C.write(t, ctx.rng.random(t.shape, dtype=np.float32))
    if buffer.on_chip:
        C.emit("gpsimd", "rand", t, t)
    return t


# ---- experimental convenience wrappers -----------------------------------------------------------------------
def load(src, dtype=None):
    if src.on_chip:
        raise SimulationError("nl.load reads an HBM tensor; for on-chip tiles use nl.copy")
    if src.ndim < 2:
        raise SimulationError(f"nl.load needs a >= 2-D HBM view (partition dim first), got shape {src.shape}")
    t = ndarray(src.shape, dtype or src.dtype, buffer=M.sbuf, name=f"load@{_call_site()}")
    isa_data.dma_copy(t, src)
    return t


def store(dst, value):
    if isinstance(value, NkiTensor) and value.kind == "psum":
        raise SimulationError("nl.store of a PSUM tile is not supported; copy it to SBUF first (nl.copy)")
    isa_data.dma_copy(dst, value)


def copy(x, dtype=None):
    t = ndarray(x.shape, dtype or x.dtype, buffer=M.sbuf, name=f"copy@{_call_site()}")
    isa_data.tensor_copy(t, x)
    return t


def transpose(x, dtype=None):
    p, f = x.shape[0], C.free(x)
    t = ndarray((f, p), dtype or x.dtype, buffer=M.psum, name=f"transpose@{_call_site()}")
    isa_tensor.nc_transpose(t, x)
    return t


def matmul(x, y, transpose_x=False):
    """PSUM fp32 ``x.T @ y`` (transpose_x=True, x is [K, M]) or ``x @ y`` (x is [M, K], PE-transposed first)."""
    if not transpose_x:
        xt_psum = transpose(x)
        x = copy(xt_psum)
    out = ndarray((C.free(x), C.free(y)), D.float32, buffer=M.psum, name=f"matmul@{_call_site()}")
    isa_tensor.nc_matmul(out, x, y, accumulate=False)
    return out


def apply_elementwise(op, *args, dtype=None):
    """``nl.<op>(x[, y], dtype=None)``: new SBUF tile; binary ops do not broadcast (§4.2)."""
    tiles = [a for a in args if isinstance(a, NkiTensor)]
    if not tiles:
        raise SimulationError(f"nl.{op.name} needs at least one tensor argument")
    ref = tiles[0]
    out = ndarray(ref.shape, dtype or ref.dtype, buffer=M.sbuf, name=f"{op.name}@{_call_site()}")
    if len(args) == 1:
        _unary(out, ref, op)
    elif len(args) == 2 and len(tiles) == 2:
        isa_vector.tensor_tensor(out, args[0], args[1], op)
    elif len(args) == 2:
        reverse = not isinstance(args[0], NkiTensor)
        isa_vector.tensor_scalar(out, ref, op, args[1] if not reverse else args[0], reverse0=reverse)
    else:
        raise SimulationError(f"nl.{op.name} takes one or two operands, got {len(args)}")
    return out


def broadcast_to(x, shape, dtype=None):
    """A new SBUF tile of ``shape`` (same rank; each dim equal or broadcast from 1, partition dim included)."""
    x = C.tensor(x, "broadcast_to", "x")
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim or any(a not in (1, b) for a, b in zip(x.shape, shape)):
        raise SimulationError(f"broadcast_to: cannot broadcast {x.shape} to {shape} (same rank, dims equal or 1)")
    if shape == tuple(x.shape) and (dtype is None or D.as_dtype(dtype) == x.dtype):
        return x
    out = ndarray(shape, dtype or x.dtype, buffer=M.sbuf, name=f"broadcast_to@{_call_site()}")
    if C.executing():
        vals = np.broadcast_to(C.read_f32(x), shape)
        if D.is_int(x.dtype) and D.is_int(out.dtype):
            vals = np.broadcast_to(x.read(), shape)
        C.store(out, C.cast_for(out, vals) if not D.is_int(out.dtype) else D.cast(vals, out.dtype))
    C.emit("vector", "tensor_copy", x, out, partitions=shape[0])
    return out


def _unary(out, x, op):
    if op.name == "copy":     # nl.copy: VectorE tensor_copy since 0.6 (bit-exact for equal dtypes), §4.1
        isa_data.tensor_copy(out, x)
    elif op.name in alu.ACTIVATIONS and op.name != "prelu":
        isa_scalar.activation(out, op, x)
    elif op.name in alu.ALU_UNARY or op.name == "invert":
        isa_vector.tensor_scalar(out, x, op, None)
    else:   # remaining unary math (negative, floor, cos, ...) on VectorE
        C.same_free("nl." + op.name, dst=out, data=x)
        if C.executing():
            C.write(out, op.unary(C.read_2d(x)))
        C.emit("vector", "tensor_scalar", x, out)


def _reduce(op_name, x, axis, dtype, keepdims, name):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    first = builtins.min(a + x.ndim if a < 0 else a for a in axes)
    kept = x.shape[:first]
    shape = kept + (1,) * (x.ndim - first) if keepdims or len(kept) < 2 else kept
    out = ndarray(shape, dtype or x.dtype, buffer=M.sbuf, name=f"{name}@{_call_site()}")
    isa_vector.tensor_reduce(out, alu.OPS[op_name], x, axes)
    return out


def sum(x, axis, dtype=None, keepdims=False):
    return _reduce("add", x, axis, dtype, keepdims, "sum")


def max(x, axis, dtype=None, keepdims=False):
    return _reduce("maximum", x, axis, dtype, keepdims, "max")


def min(x, axis, dtype=None, keepdims=False):
    return _reduce("minimum", x, axis, dtype, keepdims, "min")


def mean(x, axis, dtype=None, keepdims=False):
    total = _reduce("add", x, axis, D.float32, keepdims, "mean")
    count = x.size // (total.size or 1)
    out = ndarray(total.shape, dtype or x.dtype, buffer=M.sbuf, name=f"mean@{_call_site()}")
    isa_vector.tensor_scalar(out, total, alu.OPS["multiply"], 1.0 / count)
    return out
