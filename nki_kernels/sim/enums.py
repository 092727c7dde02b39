"""``nki.isa`` enumerations with the values of the NKI 0.6 API reference (NKI documentation).

Raw integers and strings are rejected where an enum is expected, except ``dge_mode``, whose documented integer
values (0 unknown, 1 swdge, 2 hwdge, 3 none) are accepted. ``nc_version`` members are ordered
(``get_nc_version() >= nc_version.gen3``).
"""
from __future__ import annotations

import functools
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
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    error = "error"
    skip = "skip"


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


@functools.total_ordering
class nc_version(Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other):
        if not isinstance(other, nc_version):
            return NotImplemented
        return self.value < other.value


class dma_engine(Enum):
    dma = "dma"
    gpsimd_dma = "gpsimd_dma"


def require(value, enum_cls, op: str, arg: str):
    """Check that ``value`` is a member of ``enum_cls`` (0.3+ rejects raw ints and strings)."""
    if value is None:
        return None
    if enum_cls is dge_mode and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return dge_mode(value)
    if not isinstance(value, enum_cls):
        raise SimulationError(f"{op} {arg} must be a nisa.{enum_cls.__name__} member, got {value!r}")
    return value
