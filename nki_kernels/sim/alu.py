"""ALU operators and activation functions (NKI documentation).

Each ``nl.<name>`` is one ``NkiOp`` object: it is the operator identifier passed to ``nisa`` instructions
(``op=nl.add``) and, called directly, the experimental ``nki.language`` element-wise function (``nl.exp(t)``).
Arithmetic is evaluated in fp32 (transcendentals through float64, then rounded to fp32).
"""
from __future__ import annotations

import numpy as np

from .errors import SimulationError

_F64 = np.float64


def _erf(x):
    """erf in float64 without SciPy: Maclaurin series for |x| < 2.5, Abramowitz-Stegun 7.1.26 beyond (abs err
    < 1.5e-7 where |erf| > 0.9995, i.e. within ~2 fp32 ulps)."""
    x = np.asarray(x, dtype=_F64)
    ax = np.minimum(np.abs(x), 2.5)
    term, total = ax.copy(), ax.copy()
    x2 = ax * ax
    for n in range(1, 60):
        term = -term * x2 / n
        total = total + term / (2 * n + 1)
    series = total * (2.0 / np.sqrt(np.pi))
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    tail = 1.0 - poly * np.exp(-x * x)
    return np.sign(x) * np.where(np.abs(x) < 2.5, series, tail)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _gelu_dx(x):
    return 0.5 * (1.0 + _erf(x / np.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


def _gelu_sig_dx(x):
    s = _sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _safe(fn):
    def wrapped(x):
        with np.errstate(all="ignore"):
            return fn(np.asarray(x, dtype=_F64)).astype(np.float32)
    return wrapped


UNARY = {
    "copy": lambda x: x, "identity": lambda x: x, "square": lambda x: x * x, "abs": np.abs,
    "negative": np.negative, "sign": np.sign, "ceil": np.ceil, "floor": np.floor, "trunc": np.trunc,
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x, "sin": np.sin, "cos": np.cos, "tan": np.tan, "arctan": np.arctan,
    "tanh": np.tanh, "sigmoid": _sigmoid, "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0))), "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(1.702 * x), "gelu_dx": _gelu_dx,
    "gelu_apprx_sigmoid_dx": _gelu_sig_dx, "silu": lambda x: x * _sigmoid(x), "silu_dx": _silu_dx,
    "softplus": _softplus, "mish": lambda x: x * np.tanh(_softplus(x)), "erf": _erf,
    "erf_dx": lambda x: 2.0 / np.sqrt(np.pi) * np.exp(-x * x), "logical_not": lambda x: (x == 0).astype(_F64),
}
# ScalarE activation table (§5.2 / A.7). prelu is handled separately (needs relu_param).
ACTIVATIONS = {"copy", "identity", "square", "sigmoid", "relu", "prelu", "gelu", "gelu_dx", "gelu_apprx_tanh",
               "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "tanh", "softplus", "mish", "erf",
               "erf_dx", "exp", "log", "sin", "arctan", "sqrt", "rsqrt", "reciprocal", "sign", "abs"}
# Unary ALU ops usable as tensor_scalar op (operand ignored), §5.3.
ALU_UNARY = {"abs", "square", "relu", "rsqrt", "reciprocal"}


def _abs_pick(x, y, larger):
    ax, ay = np.abs(x), np.abs(y)
    return np.where(ax > ay, x, y) if larger else np.where(ax < ay, x, y)


def _logical_rshift(x, y):
    """Logical (zero-filling) right shift at the operand's own width (arithmetic shift is not supported, §5.3)."""
    x = np.asarray(x)
    unsigned = x.astype(x.dtype.str.replace("i", "u")) if x.dtype.kind == "i" else x
    return np.right_shift(unsigned, np.asarray(y).astype(unsigned.dtype)).astype(x.dtype)


def _cmp(fn):
    return lambda x, y: fn(x, y).astype(np.float32)


BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power, "fmod": np.fmod, "mod": np.mod,
    "abs_max": lambda x, y: _abs_pick(x, y, True), "abs_min": lambda x, y: _abs_pick(x, y, False),
    "equal": _cmp(np.equal), "not_equal": _cmp(np.not_equal), "less": _cmp(np.less),
    "less_equal": _cmp(np.less_equal), "greater": _cmp(np.greater), "greater_equal": _cmp(np.greater_equal),
    "logical_and": _cmp(lambda x, y: (x != 0) & (y != 0)), "logical_or": _cmp(lambda x, y: (x != 0) | (y != 0)),
    "logical_xor": _cmp(lambda x, y: (x != 0) ^ (y != 0)), "bypass": lambda x, y: x,
}
BITVEC = {
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift, "right_shift": lambda x, y: _logical_rshift(x, y),
    "invert": lambda x, y=None: np.invert(x),
}
class _AbsPick:
    """abs_max / abs_min as a reducer: keeps the signed value of larger / smaller magnitude (ties -> later)."""

    def __init__(self, larger: bool):
        self.larger = larger

    def __call__(self, x, y):
        return _abs_pick(x, y, self.larger)

    def reduce(self, values, axis):
        mag = np.abs(values)
        pick = np.argmax(mag, axis=axis) if self.larger else np.argmin(mag, axis=axis)
        return np.take_along_axis(values, np.expand_dims(pick, axis), axis=axis).squeeze(axis)


# Reducible operators (§5.3): name -> (NumPy reduction, identity for register reset).
REDUCERS = {
    "add": (np.add, 0.0), "multiply": (np.multiply, 1.0), "maximum": (np.maximum, -np.inf),
    "minimum": (np.minimum, np.inf), "logical_and": (np.logical_and, 1.0), "logical_or": (np.logical_or, 0.0),
    "logical_xor": (np.logical_xor, 0.0), "bitwise_and": (np.bitwise_and, -1), "bitwise_or": (np.bitwise_or, 0),
    "bitwise_xor": (np.bitwise_xor, 0), "abs_max": (_AbsPick(True), 0.0), "abs_min": (_AbsPick(False), np.inf),
}
GEN4_ONLY = {"abs_max", "abs_min"}
# GpSimd computes these natively on 32-bit integers (int32 tensor_tensor defaults to GpSimd, §5 intro)
_INT_NATIVE = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
               "minimum": np.minimum}


class NkiOp:
    """An NKI operator constant (``nl.add``, ``nl.exp``, ...). Calling it runs the ``nki.language`` wrapper."""

    def __init__(self, name: str):
        self.name = name

    @property
    def is_bitvec(self) -> bool:
        return self.name in BITVEC

    @property
    def is_binary(self) -> bool:
        return self.name in BINARY or (self.name in BITVEC and self.name != "invert")

    @property
    def is_unary(self) -> bool:
        return self.name in UNARY or self.name == "invert"

    def binary(self, x, y, integer: bool = False):
        """Apply as a binary ALU op: fp32 in, fp32 out (bit-vector ops, or ``integer=True`` for GpSimd int32
        arithmetic: integer in, integer out, wrapping)."""
        if self.is_bitvec:
            return BITVEC[self.name](x, y)
        if integer and self.name in _INT_NATIVE:
            return np.asarray(_INT_NATIVE[self.name](np.asarray(x, np.int64), np.asarray(y, np.int64)))
        if self.name not in BINARY:
            if self.name in ALU_UNARY:
                return self.unary(x)
            raise ValueError(f"nl.{self.name} is not a binary ALU operator")
        with np.errstate(all="ignore"):
            return np.asarray(BINARY[self.name](np.float32(x) if np.isscalar(x) else x, y), dtype=np.float32)

    def unary(self, x):
        if self.name == "invert":
            return np.invert(x)
        return _safe(UNARY[self.name])(x)

    def __call__(self, *args, **kwargs):
        from . import language_ops  # local import: language_ops builds on the instruction modules
        return language_ops.apply_elementwise(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


# Operators the simulator uses internally but the real nki.language does not export.
SIMULATOR_ONLY = frozenset({"identity"})


def make_ops() -> dict[str, NkiOp]:
    names = set(UNARY) | set(BINARY) | set(BITVEC) | {"prelu", "average"}
    return {n: NkiOp(n) for n in sorted(names)}


OPS = make_ops()


def get(op, what: str) -> NkiOp:
    """Accept an NkiOp or a NumPy ufunc (legacy style, §1.2) and return the NkiOp."""
    if isinstance(op, NkiOp):
        return op
    name = getattr(op, "__name__", None)
    alias = {"max": "maximum", "min": "minimum", "sum": "add", "true_divide": "divide", "absolute": "abs"}
    name = alias.get(name, name)
    if name in OPS:
        return OPS[name]
    raise SimulationError(f"{what}: {op!r} is not an NKI operator; pass one of nl.add, nl.multiply, nl.exp, ...")
