"""``nki.isa`` enumerations (nki-reference.md §5 intro). Raw integers are rejected where an enum is expected."""
from __future__ import annotations

from enum import Enum

from .errors import SimulationError


class engine(Enum):
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


class reduce_cmd(Enum):
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class dge_mode(Enum):
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode(Enum):
    error = "error"
    skip = "skip"


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):
    dma = "dma"
    gpsimd_dma = "gpsimd_dma"


def require(value, enum_cls, op: str, arg: str):
    """Check that ``value`` is a member of ``enum_cls`` (0.3+ rejects raw ints and strings)."""
    if value is None:
        return None
    if not isinstance(value, enum_cls):
        raise SimulationError(f"{op} {arg} must be a nisa.{enum_cls.__name__} member, got {value!r}")
    return value
