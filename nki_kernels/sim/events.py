"""Instruction events emitted by the NKI simulator, one per executed instruction.

The cost model (nki_kernels/sim/cost.py) consumes these through a ``Recorder``. The interpreter never
depends on what a recorder does with an event; it only calls ``recorder.record(event)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class InstrEvent:
    """One simulated instruction, described by what a cost model needs to know."""

    engine: str          # "tensor" | "vector" | "scalar" | "gpsimd" | "dma"
    op: str              # instruction name, e.g. "nc_matmul", "activation", "dma_copy"
    partitions: int      # partition count of the main operand (dst for most ops)
    free_elems: int      # elements per partition processed (of the main input; for matmul: moving free size N)
    in_dtype: str        # numpy/ml_dtypes dtype name of the main input, e.g. "bfloat16"
    out_dtype: str
    matmul_kmn: tuple[int, int, int] | None = None   # (K contraction rows, M stationary free, N moving free)
    perf_mode: str | None = None                      # "double_row" | "mx" | None
    dma_bytes: int = 0                                # bytes moved (dma ops)
    src_buffer: str = ""                              # "hbm" | "sbuf" | "psum"
    dst_buffer: str = ""
    is_transpose: bool = False                        # nc_matmul(is_transpose=True): data movement, no FLOPs


class Recorder(Protocol):
    """Anything with a ``record`` method can receive the events of a simulated run."""

    def record(self, ev: InstrEvent) -> None: ...


class ListRecorder:
    """A recorder that keeps every event in a list (handy for tests and quick inspection)."""

    def __init__(self) -> None:
        self.events: list[InstrEvent] = []

    def record(self, ev: InstrEvent) -> None:
        self.events.append(ev)
