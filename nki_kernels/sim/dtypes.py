"""NKI data types for the simulator (NKI documentation) and the cast-on-write rules (§6.2, A.3).

Ordinary types are NumPy / ml_dtypes dtypes, so ``t.dtype == nl.bfloat16`` and ``np.float32`` arguments work.
Types without a NumPy equivalent (``tfloat32`` and the packed MX "x4" types) are ``SpecialDType`` objects that
record the container dtype actually stored.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import SimulationError


class SpecialDType:
    """A dtype NumPy cannot express: tf32 (fp32 storage, 10 mantissa bits) or 4 packed low-precision values."""

    def __init__(self, name: str, container: np.dtype, element: np.dtype | None = None, per_word: int = 1):
        self.name = name
        self.container = np.dtype(container)
        self.element = None if element is None else np.dtype(element)
        self.per_word = per_word
        self.itemsize = self.container.itemsize

    @property
    def is_x4(self) -> bool:
        return self.per_word == 4

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __eq__(self, other) -> bool:
        return isinstance(other, SpecialDType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("nki-special", self.name))


float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)        # IEEE-like fp8, max 240 (Trn2 native "e4m3")
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)    # OCP e4m3, max 448
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)  # MX scale
float4_e2m1fn = np.dtype(ml_dtypes.float4_e2m1fn)
int8, int16, int32 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32)
uint8, uint16, uint32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)
tfloat32 = SpecialDType("tfloat32", np.float32)
float8_e4m3fn_x4 = SpecialDType("float8_e4m3fn_x4", np.uint32, float8_e4m3fn, 4)
float8_e5m2_x4 = SpecialDType("float8_e5m2_x4", np.uint32, float8_e5m2, 4)
float4_e2m1fn_x4 = SpecialDType("float4_e2m1fn_x4", np.uint16, float4_e2m1fn, 4)

_BY_NAME = {
    d.name if isinstance(d, SpecialDType) else str(d): d
    for d in (float32, float16, bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
              float4_e2m1fn, int8, int16, int32, uint8, uint16, uint32, bool_, tfloat32,
              float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
}
_BY_NAME.update({"bool_": bool_, "fp32": float32, "bf16": bfloat16, "fp16": float16})
FP8_TYPES = (float8_e4m3, float8_e4m3fn, float8_e5m2)
LOW_PRECISION = (bfloat16, float16) + FP8_TYPES
FP32_MIN = float(np.finfo(np.float32).min)  # -3.4028235e38, the mask fill value of range_select / affine_select


def as_dtype(dt):
    """Normalise anything dtype-like (NumPy type, dtype, ml_dtypes type, name string, special) to an NKI dtype."""
    if isinstance(dt, SpecialDType):
        return dt
    if isinstance(dt, str):
        if dt not in _BY_NAME:
            raise SimulationError(f"unknown dtype name {dt!r}; use an nl.<dtype> constant such as nl.bfloat16")
        return _BY_NAME[dt]
    try:
        d = np.dtype(dt)
    except TypeError as exc:
        raise SimulationError(f"{dt!r} is not a dtype; use an nl.<dtype> constant such as nl.float32") from exc
    if d.kind not in "biuf" and d not in _BY_NAME.values():
        raise SimulationError(f"dtype {d} is not supported by NKI (NKI documentation)")
    return d


_NAMES: dict = {}


def dtype_name(dt) -> str:
    name = _NAMES.get(dt)
    if name is None:
        name = _NAMES[dt] = dt.name if isinstance(dt, SpecialDType) else str(np.dtype(dt))
    return name


def storage_dtype(dt) -> np.dtype:
    """The NumPy dtype whose array holds the values of ``dt``."""
    return dt.container if isinstance(dt, SpecialDType) else np.dtype(dt)


def itemsize(dt) -> int:
    return storage_dtype(dt).itemsize


def is_int(dt) -> bool:
    return not isinstance(dt, SpecialDType) and np.dtype(dt).kind in "biu"


def is_float(dt) -> bool:
    return dt == tfloat32 or (not isinstance(dt, SpecialDType) and not is_int(dt))


def is_x4(dt) -> bool:
    return isinstance(dt, SpecialDType) and dt.is_x4


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round fp32 values to tf32 precision (10 explicit mantissa bits, round-to-nearest-even), keep fp32 storage."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & np.uint32(0xFFFFE000)
    finite = np.isfinite(x)
    return np.where(finite, rounded, bits).view(np.float32)


def cast(values: np.ndarray, dt) -> np.ndarray:
    """Cast fp32 (or integer, for bit-vector ops) results to the storage array of ``dt`` (A.3 step 3).

    Floats: RNE through ml_dtypes/NumPy (overflow gives inf/NaN as ml_dtypes does). Float -> int: round half to
    even, NaN -> 0, then saturate to the integer range (simulator 0.6 behaviour, §6.2).
    """
    if is_x4(dt):
        raise SimulationError(f"cannot write computed values into a packed {dt.name} tensor; use quantize_mx")
    if dt == tfloat32:
        return round_tf32(np.asarray(values, dtype=np.float32))
    d = np.dtype(dt)
    v = np.asarray(values)
    if d.kind == "b":
        return v != 0
    if d.kind in "iu":
        if v.dtype.kind in "iub":
            return v.astype(d)  # integer -> integer keeps the low bits (bit-vector ops)
        info = np.iinfo(d)
        r = np.rint(np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=info.max, neginf=info.min))
        return np.clip(r, info.min, info.max).astype(d)
    return v.astype(d)


def to_f32(values: np.ndarray, dt) -> np.ndarray:
    """Widen stored values to fp32 for engine arithmetic (A.3 step 1)."""
    if is_x4(dt):
        raise SimulationError(f"packed {dt.name} data can only feed nc_matmul_mx; unpack it with quantize_mx rules")
    return np.asarray(values).astype(np.float32)
