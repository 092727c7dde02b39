"""A scripted clock for the speculation gate: step times are chosen by the test, never measured."""
from __future__ import annotations

from neuron_infer.runtime.spec_gate import PROBE_EVERY, SpecGate
from neuron_infer.runtime.step_clock import StepClock


class Scripted:
    """A fake clock: the engine's step calls advance it by their scripted cost and log their kind ("S" / "P")."""

    def __init__(self, spec_cost, plain_cost: float = 1.0, probe_every: int = PROBE_EVERY, catch_cost: float = 0.0):
        self.now, self.kinds, self.probe_every, self.catch_cost = 0.0, [], probe_every, catch_cost
        self.spec_cost = spec_cost if callable(spec_cost) else (lambda _step: spec_cost)
        self.plain_cost = plain_cost

    def __call__(self) -> float:
        return self.now

    def install(self, se, set_attr=setattr) -> None:
        """Wrap the SpecEngine's step calls and give it a fresh gate on this clock (`set_attr`: pytest's
        monkeypatch.setattr, or setattr in a throw-away rank process)."""
        step_tokens, decode_rows = se.step_tokens, se.target.decode_rows  # a plain step runs the target alone

        def spec(*a, **kw):
            self.now += self.spec_cost(len(self.kinds))
            self.kinds.append("S")
            return step_tokens(*a, **kw)

        def plain(*a, **kw):
            self.now += self.plain_cost
            self.kinds.append("P")
            return decode_rows(*a, **kw)

        catch_up = se.catch_up

        def catch(*a, **kw):  # costs catch_cost per missing position
            passes, missing = catch_up(*a, **kw)
            self.now += self.catch_cost * missing
            return passes, missing

        set_attr(se, "catch_up", catch)
        set_attr(se, "step_tokens", spec)
        set_attr(se.target, "decode_rows", plain)
        set_attr(se, "gate", SpecGate(StepClock(self), self.probe_every))
