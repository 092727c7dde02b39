"""``nisa.NkiScalar``, ``nisa.scalar_load`` and ``nisa.scalar_store`` (NKI 0.7 API reference, Neuron SDK 2.33:
nki.isa.NkiScalar, nki.isa.scalar_load, nki.isa.scalar_store; deep dive "NKI Scalar Values").

A scalar holds one integer computed on device, of dtype nl.int32 or nl.int64 (fixed when it is loaded). Arithmetic
returns a new scalar: ``+``, ``-`` (binary and unary) and ``*`` at both widths, wrapping at the width (int32
arithmetic never widens). Comparisons are traced at int32 but "the result cannot be used" (here: reading it raises)
and are rejected at int64. A scalar is a ``scalar_offset`` of an access pattern (int64 only on HBM) and an int32
bound of ``nl.fori_loop``; it is not a Python int (no ``bool()``, no indexing). The simulator runs the kernel in
order, so a scalar's value is known when it is used.
"""
from __future__ import annotations

import numpy as np

from . import checks as C
from .api_version import added_in_07
from .errors import SimulationError

_WIDTH = ("int32", "int64")


def _wrap(value: int, dtype: str) -> int:
    """Two's-complement wrap at the scalar's width (a 32-bit scalar is never widened)."""
    bits = 32 if dtype == "int32" else 64
    return (value + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)


class NkiScalar:
    """One device integer (``nisa.scalar_load``); arithmetic yields new scalars."""

    def __init__(self, state, dtype=None, is_comparison=False):
        self.dtype = _dtype_name(dtype or "int32")
        self._state, self.is_comparison = _wrap(int(state), self.dtype), bool(is_comparison)

    @property
    def value(self) -> int:
        if self.is_comparison:
            raise SimulationError("the result of an NkiScalar comparison cannot be used (NKI 0.7 API reference)")
        return self._state

    def __repr__(self) -> str:
        return f"NkiScalar({self._state}, dtype=nl.{self.dtype})"

    def _other(self, other, op: str) -> int:
        if isinstance(other, NkiScalar):
            if other.dtype != self.dtype:
                raise SimulationError(f"NkiScalar {op}: operands must have the same dtype, got nl.{self.dtype} and "
                                      f"nl.{other.dtype}")
            return other.value
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            return int(other)
        raise SimulationError(f"NkiScalar {op}: the other operand must be a Python int or an NkiScalar, got "
                              f"{type(other).__name__}")

    def _arith(self, other, op: str, fn, reverse=False):
        b = self._other(other, op)
        a = self.value
        return NkiScalar(fn(b, a) if reverse else fn(a, b), self.dtype)

    def __add__(self, o):
        return self._arith(o, "+", lambda a, b: a + b)

    def __radd__(self, o):
        return self._arith(o, "+", lambda a, b: a + b, reverse=True)

    def __sub__(self, o):
        return self._arith(o, "-", lambda a, b: a - b)

    def __rsub__(self, o):
        return self._arith(o, "-", lambda a, b: a - b, reverse=True)

    def __mul__(self, o):
        return self._arith(o, "*", lambda a, b: a * b)

    def __rmul__(self, o):
        return self._arith(o, "*", lambda a, b: a * b, reverse=True)

    def __neg__(self):
        return NkiScalar(-self.value, self.dtype)

    def _compare(self, other, op: str, fn):
        if self.dtype == "int64":
            raise SimulationError(f"NkiScalar {op} is rejected at nl.int64 (only +, - and * exist at 64 bits)")
        return NkiScalar(int(fn(self.value, self._other(other, op))), self.dtype, is_comparison=True)

    def __lt__(self, o):
        return self._compare(o, "<", lambda a, b: a < b)

    def __le__(self, o):
        return self._compare(o, "<=", lambda a, b: a <= b)

    def __gt__(self, o):
        return self._compare(o, ">", lambda a, b: a > b)

    def __ge__(self, o):
        return self._compare(o, ">=", lambda a, b: a >= b)

    def __eq__(self, o):
        return self._compare(o, "==", lambda a, b: a == b)

    def __ne__(self, o):
        return self._compare(o, "!=", lambda a, b: a != b)

    __hash__ = object.__hash__

    def __bool__(self):
        raise SimulationError("an NkiScalar has no Python truth value (it is computed on device); use "
                              "nl.while_loop for a data-dependent loop")

    def __index__(self):
        raise SimulationError("an NkiScalar is not a Python int; address with .ap(..., scalar_offset=scalar)")


def _dtype_name(dtype) -> str:
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    name = str(name).replace("nl.", "")
    if name not in _WIDTH:
        raise SimulationError(f"an NkiScalar is nl.int32 or nl.int64, got {dtype}")
    return name


def _one_by_one(t, op: str, role: str):
    t = C.tensor(t, op, role)
    C.buffers(t, ("hbm", "sbuf"), op, role)
    if t.size != 1:
        raise SimulationError(f"{op} {role} must be a 1x1 tensor, got {t.shape}")
    if t.np_dtype.kind != "i" or t.np_dtype.itemsize not in (4, 8):
        raise SimulationError(f"{op} {role} must have dtype nl.int32 or nl.int64 (unsigned dtypes are not "
                              f"accepted), got {t.dtype}")
    return t


def scalar_load(src):
    """Load a 1x1 nl.int32 / nl.int64 tensor (SBUF or HBM) into an NkiScalar of the same dtype."""
    added_in_07("nisa.scalar_load")
    t = _one_by_one(src, "scalar_load", "src")
    dtype = "int32" if t.np_dtype.itemsize == 4 else "int64"
    value = int(np.asarray(t.read()).reshape(-1)[0]) if C.executing() else 0
    return NkiScalar(value, dtype)


def scalar_store(dst, value):
    """Store an NkiScalar into a 1x1 tensor of the same width (a Python int is refused)."""
    added_in_07("nisa.scalar_store")
    t = _one_by_one(dst, "scalar_store", "dst")
    if not isinstance(value, NkiScalar):
        raise SimulationError(f"scalar_store value must be an NkiScalar, got {type(value).__name__} (use "
                              "nisa.memset to write a constant)")
    width = "int32" if t.np_dtype.itemsize == 4 else "int64"
    if width != value.dtype:
        raise SimulationError(f"scalar_store: a nl.{value.dtype} scalar cannot be stored into a nl.{width} tile")
    if C.executing():
        C.write(t, np.full(t.shape, value.value))
