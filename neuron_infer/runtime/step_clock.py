"""Measured step costs: an EWMA of the wall time of each kind of step (the first sample of each kind is warm-up).

One implementation for every policy that weighs a speculative step against a plain one: prompt lookup
(`NgramSpec`: verify vs plain) and the draft-model gate (`SpecGate`: speculative vs plain). The timer is injectable
so tests decide the "measured" times.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

TIME_ALPHA = 0.2  # weight of the newest step time


class StepClock:
    """EWMA wall time per kind of step ("plain", "verify", "spec", ...); the first sample of each kind is skipped
    (graph loading, first allocations)."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.mean: dict[str, float] = {}
        self.seen: dict[str, int] = {}

    def add(self, kind: str, seconds: float, warm_up: bool = True) -> None:
        """One sample of `kind`; with `warm_up` the kind's first sample is skipped."""
        n = self.seen.get(kind, 0)
        self.seen[kind] = n + 1
        if n == 0 and warm_up:
            return
        old = self.mean.get(kind)
        self.mean[kind] = seconds if old is None else (1 - TIME_ALPHA) * old + TIME_ALPHA * seconds

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Time the body as one step of `kind`."""
        t0 = self.timer()
        yield
        self.add(kind, self.timer() - t0)

    def measured(self, kind: str) -> bool:
        return kind in self.mean

    def ratio(self, kind: str, base: str, prior: float) -> float:
        """mean(kind) / mean(base), or `prior` until both are measured."""
        if self.measured(kind) and self.measured(base) and self.mean[base] > 0:
            return self.mean[kind] / self.mean[base]
        return prior
