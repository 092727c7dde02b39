"""Conversion of kernel arguments (NumPy / torch) to HBM tensors and of results back (A.1)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from . import dtypes as D
from . import memory as M
from .errors import SimulationError
from .tensor import NkiTensor, _row_major

_TORCH_TO_ML = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
                "float8_e5m2": ml_dtypes.float8_e5m2, "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


class ArgConverter:
    """Wraps arguments into HBM tensors and remembers how to write results back to the caller."""

    def __init__(self, precise: bool, execute: bool):
        self.precise, self.execute = precise, execute
        self.torch_mode = False
        self._write_backs = []   # (storage, numpy target, torch target or None)

    def wrap(self, args, kwargs, shared, spec_cls):
        self.torch_mode = any(_is_torch(a) for a in _leaves(list(args) + list(kwargs.values())))
        conv = lambda a, n: self._one(a, n, shared, spec_cls)
        return (tuple(conv(a, f"arg{i}") for i, a in enumerate(args)),
                {k: conv(v, k) for k, v in kwargs.items()})

    def _one(self, a, name, shared, spec_cls):
        if isinstance(a, spec_cls):
            st = M.new_storage(name, M.KERNEL_ARG_HBM, tuple(a.shape), D.as_dtype(a.dtype), self.precise, self.execute)
            return NkiTensor(st, st.dtype, 0, _row_major(st.shape))
        torch_src = None
        if _is_torch(a):
            torch_src, a = a, _torch_to_numpy(a)
        if isinstance(a, tuple):
            return tuple(self._one(v, f"{name}[{i}]", shared, spec_cls) for i, v in enumerate(a))
        if isinstance(a, dict):
            return {k: self._one(v, f"{name}[{k!r}]", shared, spec_cls) for k, v in a.items()}
        if not isinstance(a, np.ndarray):
            if isinstance(a, list):
                raise SimulationError(f"kernel argument {name!r} is a list; NKI kernels take tuples (0.3-0.6 parser)")
            return a
        return self._array(a, name, torch_src)

    def _array(self, arr, name, torch_src):
        try:
            dt = D.as_dtype(arr.dtype)
        except SimulationError as exc:
            raise SimulationError(f"kernel argument {name!r}: {exc}; cast it to an NKI dtype (e.g. float32)") from exc
        if arr.dtype == np.float64 or arr.dtype == np.int64 or arr.ndim == 0:
            raise SimulationError(f"kernel argument {name!r} has dtype {arr.dtype} / shape {arr.shape}; NKI tensors "
                                  f"need >= 1-D float32/bf16/fp16/fp8/int<=32 data")
        shape = arr.shape
        st = M.new_storage(name, M.KERNEL_ARG_HBM, shape, dt, self.precise, execute=False)
        zero_copy = (st.backing == arr.dtype and arr.flags.c_contiguous and arr.flags.writeable
                     and (torch_src is None or torch_src.is_contiguous()))
        if zero_copy:
            st.raw = arr.reshape(-1).view(np.uint8)
        elif self.execute:
            nbytes = math.prod(shape) * st.backing.itemsize
            st.raw = np.empty(nbytes + (-nbytes) % 4, dtype=np.uint8)
            st.raw[:nbytes].view(st.backing)[...] = arr.reshape(-1).astype(st.backing)
            self._write_backs.append((st, arr, torch_src))
        return NkiTensor(st, dt, 0, _row_major(shape))

    def write_back(self) -> None:
        """Copy results into caller arrays that could not be shared zero-copy."""
        for st, arr, torch_src in self._write_backs:
            vals = st.typed(st.backing)[: st.elements].reshape(arr.shape)
            if torch_src is not None:
                torch_src.copy_(_numpy_to_torch(vals.astype(arr.dtype)))
            elif arr.flags.writeable:
                arr[...] = vals.astype(arr.dtype)

    def unwrap(self, result):
        if isinstance(result, (tuple, list)):
            return type(result)(self.unwrap(r) for r in result)
        if not isinstance(result, NkiTensor):
            return result
        arr = result.read().copy()
        if result.np_dtype != D.storage_dtype(result.dtype):   # NKI_PRECISE_FP=0: fp32 backing -> declared dtype
            arr = arr.astype(D.storage_dtype(result.dtype))
        return _numpy_to_torch(arr) if self.torch_mode else arr


def _leaves(items):
    for a in items:
        if isinstance(a, (tuple, list)):
            yield from _leaves(a)
        elif isinstance(a, dict):
            yield from _leaves(list(a.values()))
        else:
            yield a


def _torch_to_numpy(t) -> np.ndarray:
    import torch  # lazy: only when the caller passed torch tensors

    t = t.detach()
    if t.device.type != "cpu":
        raise SimulationError(f"the NKI simulator runs on CPU tensors; got a tensor on {t.device}")
    name = str(t.dtype).replace("torch.", "")
    if name in _TORCH_TO_ML:
        width = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return t.view(width).numpy().view(_TORCH_TO_ML[name])
    if name == "bool":
        return t.numpy()
    return t.numpy()


def _numpy_to_torch(arr: np.ndarray):
    import torch

    name = str(arr.dtype)
    if name in _TORCH_TO_ML and hasattr(torch, name):
        width = {1: np.uint8, 2: np.int16}[arr.dtype.itemsize]
        return torch.from_numpy(np.ascontiguousarray(arr).view(width)).view(getattr(torch, name))
    if name.startswith(("float8", "float4")):
        # torch has no such dtype (e.g. IEEE-like float8_e4m3, max 240): return the raw bytes as uint8
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(arr))
