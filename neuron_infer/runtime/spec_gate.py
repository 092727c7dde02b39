"""SpecGate: per step, whether a draft-model speculative step pays, from measured step times and yields.

A speculative step emits E tokens per sequence (an EWMA of what the steps emitted) in time S; a plain step emits 1 in
time P (the target alone: plain steps leave the draft cache to `SpecEngine.catch_up`, which runs before a speculative
step, outside its timing). Speculation pays when

    E / (S / P) > 1

S and P are EWMAs of wall times (`StepClock`, the first sample of each kind is warm-up). Policy (`want`):
    no speculative step measured yet     speculate (optimistic start)
    no plain step measured yet           plain (to measure one)
    `interval` plain steps in a row      speculate once (a probe: a change in acceptance is noticed)
    otherwise                            speculate iff E * P / S > 1
The probe interval starts at `probe_every` and doubles after each probe that finds speculation still not paying, up
to `probe_every` * MAX_BACKOFF; it returns to `probe_every` once speculation pays. A probe also costs the draft's
catch-up on every position the plain steps before it skipped (`SpecEngine.catch_up`), whatever the interval, so the
gate measures that cost per position (`record_catch_up`) and probes only while it is at most CATCH_UP_BUDGET of a
plain step: a draft too slow for that stays off (a plain step per step) until speculation is measured to pay again,
which without probes it is not. The Runner asks `want` only when a speculative step is possible (one
shared sampling rule, room before max_length, no seeded sequence scheduled), times the step it takes through
`clock`, and reports each speculative step's yield (`record_spec`).
"""
from __future__ import annotations

from neuron_infer.runtime.step_clock import StepClock

PROBE_EVERY = 16  # plain steps in a row after which one speculative step is taken again (at first)
MAX_BACKOFF = 16  # the probe interval grows up to PROBE_EVERY * MAX_BACKOFF plain steps
CATCH_UP_BUDGET = 0.1  # probe only while the draft's catch-up per position costs at most this share of a plain step
TOKENS_ALPHA = 0.3  # weight of the newest speculative step's tokens per sequence


class SpecGate:
    """The gate's measurements and decision (one per SpecEngine, so they outlive a Runner: a loaded model keeps
    what it measured across generate calls; see the module docstring)."""

    def __init__(self, clock: StepClock | None = None, probe_every: int = PROBE_EVERY):
        self.clock = clock or StepClock()
        self.probe_every = probe_every
        self.interval = probe_every  # plain steps in a row before the next probe
        self.probing = False  # the last speculative step was a probe
        self.tokens: float | None = None  # EWMA tokens per sequence per speculative step
        self.plain_run = 0  # plain steps since the last speculative step

    @property
    def payoff(self) -> float | None:
        """Expected tokens per speculative step / (its time / a plain step's time); None until measured."""
        c = self.clock
        if self.tokens is None or not (c.measured("spec") and c.measured("plain")) or c.mean["spec"] <= 0:
            return None
        return self.tokens * c.mean["plain"] / c.mean["spec"]

    def summary(self) -> dict:
        """What the decisions rest on: mean plain and speculative step (ms), the draft's catch-up per position (ms),
        tokens per speculative step and per sequence, their payoff (0 until measured)."""
        mean = self.clock.mean
        return {"plain_ms": 1000 * mean.get("plain", 0.0), "spec_ms": 1000 * mean.get("spec", 0.0),
                "catch_up_ms_per_position": 1000 * mean.get("catch", 0.0),
                "tokens_per_spec_step": self.tokens or 0.0, "payoff": self.payoff or 0.0}

    def want(self) -> bool:
        """This process's choice for the next step that could speculate (tensor parallelism agrees on rank 0's)."""
        if not self.clock.measured("spec"):
            return True
        if not self.clock.measured("plain"):
            return False
        if self.plain_run >= self.interval and self.probes_affordable():
            self.probing = True
            return True
        pays = self.payoff > 1.0
        if self.probing:  # the first decision after a probe: back off, or start over
            self.probing = False
            self.interval = self.probe_every if pays else min(2 * self.interval, self.probe_every * MAX_BACKOFF)
        return pays

    def probes_affordable(self) -> bool:
        """Whether the draft's measured catch-up per position is within CATCH_UP_BUDGET of a plain step (true until
        both are measured)."""
        c = self.clock
        if not (c.measured("catch") and c.measured("plain")):
            return True
        return c.mean["catch"] <= CATCH_UP_BUDGET * c.mean["plain"]

    def record_catch_up(self, seconds: float, positions: int) -> None:
        """The draft caught up on `positions` positions in `seconds` (nothing is recorded for none). The first
        sample counts (the first speculative step's catch-up, usually the prompts): probes are what it decides, and
        a probe would only measure it again, at the price this avoids."""
        if positions:
            self.clock.add("catch", seconds / positions, warm_up=False)

    def record_plain(self) -> None:
        """A plain step was taken although speculation was possible (its time goes through `clock`)."""
        self.plain_run += 1

    def record_spec(self, tokens_per_seq: float) -> None:
        """A speculative step emitted `tokens_per_seq` tokens per scheduled sequence on average."""
        self.plain_run = 0
        old = self.tokens
        self.tokens = tokens_per_seq if old is None else (1 - TOKENS_ALPHA) * old + TOKENS_ALPHA * tokens_per_seq
