"""Per-run interpreter state: target, program instance, allocators, engine accumulators, event recording.

A run context exists only while a kernel executes (``kernel_context``); NKI calls outside one raise.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

from .errors import SimulationError, SimulatorWarning
from .events import InstrEvent, Recorder
from .memory import Allocator
from .target import Target

_local = threading.local()
_global_recorders: list[Recorder] = []


@dataclass
class Shared:
    """State shared by the program instances of one launch (LNC2 shares HBM ``shared_hbm`` allocations).

    LNC2 programs run concurrently in two threads: ``cond`` guards the shared allocations and the cross-core
    mailboxes (``sendrecv`` data keyed by (pipe, sequence), ``core_barrier`` arrival counts); ``finished`` /
    ``failed`` let a waiting program stop when its peer can no longer answer.
    """

    storages: list = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    mailbox: dict = field(default_factory=dict)
    arrivals: dict = field(default_factory=dict)
    finished: set = field(default_factory=set)
    failed: bool = False


@dataclass
class RunContext:
    target: Target
    recorder: Recorder | None
    execute: bool
    precise_fp: bool
    program_id: int = 0
    num_programs: int = 1
    program_ndim: int = 0
    shared: Shared = field(default_factory=Shared)
    shared_index: int = 0
    sbuf: Allocator = None
    psum: Allocator = None
    act_acc: np.ndarray = None   # ScalarE accumulator registers, 128 fp32 lanes (A.4)
    vec_acc: np.ndarray = None   # VectorE accumulator registers, 128 fp32 lanes (A.4)
    no_reorder_depth: int = 0    # nesting of ``with nl.no_reorder():`` blocks
    sync_seq: dict = field(default_factory=dict)   # per (kind, pipe) count of this program's cross-core calls
    rng: np.random.Generator = None                # nl.rand state (nl.random_seed resets it)
    rank: int = 0                                  # this launch's rank in a multi-rank run (nki.collectives)
    world: object = None                           # collectives.World of a multi-rank run (None: one rank)

    def __post_init__(self):
        t = self.target
        self.sbuf = Allocator("sbuf", t.sbuf_bytes_per_partition)
        self.psum = Allocator("psum", t.psum_bytes_per_partition, unit=t.psum_bank_bytes)
        # register contents are undefined at kernel start: poison them so a kernel that reads before a reset sees NaN
        self.act_acc = np.full(t.pmax, np.nan, dtype=np.float32)
        self.vec_acc = np.full(t.pmax, np.nan, dtype=np.float32)
        self.rng = np.random.default_rng(0)

    @property
    def gen(self) -> int:
        return self.target.gen


class PeerFailed(SimulationError):
    """Raised in an LNC2 program waiting on its peer after the peer failed (the peer's error is reported)."""


def wait_for(ctx: RunContext, ready, what: str):
    """Block (LNC2) until ``ready()`` returns a value other than None; call with ``ctx.shared.cond`` held."""
    shared, peer = ctx.shared, 1 - ctx.program_id
    while True:
        value = ready()
        if value is not None:
            return value
        if shared.failed:
            raise PeerFailed(f"program {ctx.program_id}: {what}: the other program failed")
        if peer in shared.finished:
            raise SimulationError(f"program {ctx.program_id}: {what}: program {peer} returned without the matching "
                                  f"call (both cores must issue the same sendrecv / core_barrier sequence)")
        shared.cond.wait(timeout=1.0)


def current() -> RunContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise SimulationError("NKI API called outside a running kernel; launch it through nki.simulate(kernel)(...), "
                              "nki.jit or nki.simulator.simulate_kernel")
    return ctx


def active() -> RunContext | None:
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def kernel_context(ctx: RunContext):
    """Make ``ctx`` the current run context of this thread for the duration of the block."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Send the events of every kernel run inside this block to ``recorder`` (in addition to a per-run one)."""
    _global_recorders.append(recorder)
    try:
        yield recorder
    finally:
        _global_recorders.remove(recorder)


def emit(ev: InstrEvent) -> None:
    ctx = current()
    if ctx.recorder is not None:
        ctx.recorder.record(ev)
    for rec in _global_recorders:
        if rec is not ctx.recorder:
            rec.record(ev)


def warn(message: str) -> None:
    warnings.warn(message, SimulatorWarning, stacklevel=4)
