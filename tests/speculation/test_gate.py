"""The speculation gate (runtime/spec_gate.py): draft-model steps speculate only while they are measured to pay.

Step times are scripted, never measured: the Runner's gate gets a StepClock whose timer is a fake clock, and the
engine's two step calls (`step_tokens`: speculative, the target's `decode_rows`: plain) and the draft's catch-up
advance it by a chosen cost. So every decision is deterministic and each test asserts the exact sequence of step
kinds the policy implies.
"""
from __future__ import annotations

import pytest

from neuron_infer.config import SamplingConfig
from neuron_infer.runtime import runner as runner_mod
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.spec_gate import MAX_BACKOFF, PROBE_EVERY, SpecGate
from neuron_infer.runtime.step_clock import StepClock
from tests.speculation.scripted_clock import Scripted

PROMPT = list(range(5, 25))  # 20 tokens
GREEDY = SamplingConfig()


def run(se, prompts, n, gate=True, sampling=GREEDY):
    return generate_ids(se, prompts, n, sampling, ignore_eos=True, options=RunOptions(speculation_gate=gate))


def test_policy_starts_optimistic_measures_plain_then_weighs_the_payoff():
    gate = SpecGate(StepClock())
    assert gate.want()  # nothing measured: speculate
    gate.clock.add("spec", 9.0)  # warm-up, ignored
    gate.record_spec(3.0)
    assert gate.want()
    gate.clock.add("spec", 2.0)
    gate.record_spec(3.0)
    assert not gate.want()  # speculative steps measured, plain ones not yet: take plain steps to measure them
    gate.clock.add("plain", 5.0)  # warm-up
    assert not gate.want()
    gate.clock.add("plain", 1.0)
    assert gate.payoff == pytest.approx(3.0 * 1.0 / 2.0) and gate.want()  # 3 tokens for 2 plain steps' time
    gate.clock.add("spec", 22.0)  # EWMA 0.8 * 2 + 0.2 * 22 = 6
    assert gate.payoff == pytest.approx(0.5) and not gate.want()
    for _ in range(PROBE_EVERY - 1):
        gate.record_plain()
        assert not gate.want()
    gate.record_plain()
    assert gate.want()  # a probe after PROBE_EVERY plain steps in a row
    gate.record_spec(3.0)
    for _ in range(2 * PROBE_EVERY):  # the probe did not pay: twice as many plain steps before the next one
        assert not gate.want()
        gate.record_plain()
    assert gate.want()


def test_probe_interval_doubles_up_to_its_cap_and_starts_over_when_speculation_pays():
    gate = SpecGate(StepClock(), probe_every=2)
    for kind, t in (("spec", 1.0), ("spec", 4.0), ("plain", 1.0), ("plain", 1.0)):
        gate.clock.add(kind, t)
    gate.record_spec(2.0)  # payoff 2 * 1 / 4 = 0.5
    runs = []
    for _ in range(MAX_BACKOFF.bit_length() + 2):  # plain steps before each probe
        n = 0
        while not gate.want():
            gate.record_plain()
            n += 1
        runs.append(n)
        gate.record_spec(2.0)
    assert runs == [min(2 * 2 ** i, 2 * MAX_BACKOFF) for i in range(len(runs))]  # 2, 4, ... 32, 32
    while gate.payoff <= 1.0:  # speculation became cheap (the EWMA of its step time falls)
        gate.clock.add("spec", 0.1)
    assert gate.want()  # pays: speculate, and the next probe interval is probe_every again
    assert gate.interval == 2


def expected_kinds(n_steps: int, pays: bool, probe_every: int = PROBE_EVERY) -> list[str]:
    """Two speculative steps (warm-up, measured), two plain ones (warm-up, measured), then the decision: always
    speculate when it pays; else plain, with one probe after `probe_every` plain steps in a row, the interval
    doubling after each probe (up to probe_every * MAX_BACKOFF)."""
    kinds = ["S", "S", "P", "P"]
    run_, interval = 2, probe_every
    while len(kinds) < n_steps:
        if pays or run_ >= interval:
            kinds.append("S")
            if not pays:
                interval = min(2 * interval, probe_every * MAX_BACKOFF)
            run_ = 0
        else:
            kinds.append("P")
            run_ += 1
    return kinds


def test_takes_plain_steps_when_speculation_does_not_pay_and_probes(spec_engine, monkeypatch):
    se = spec_engine(draft="full", k=4)  # every draft accepted: 5 tokens per speculative step
    clock = Scripted(spec_cost=10.0, probe_every=4)  # 5 tokens in 10 plain steps' time: payoff 0.5
    clock.install(se, monkeypatch.setattr)
    got, m = run(se, [PROMPT], 60)
    assert clock.kinds == expected_kinds(len(clock.kinds), pays=False, probe_every=4)
    assert clock.kinds.count("S") >= 5  # at least three probes happened
    assert m.spec_steps == clock.kinds.count("S") and m.plain_steps == clock.kinds.count("P")
    assert m.gated_steps == m.plain_steps  # every plain step was the gate's choice (one rule, far from the end)
    assert m.speculation()["gated_steps"] == m.gated_steps
    gate = m.speculation()["gate"]  # what the decisions rested on: 5 tokens per step of 10 plain steps' time
    assert gate["payoff"] == pytest.approx(0.5) and gate["spec_ms"] == pytest.approx(10_000.0)
    ref, _ = generate_ids(se.target, [PROMPT], 60, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids


def test_speculates_when_it_pays(spec_engine, monkeypatch):
    se = spec_engine(draft="full", k=4)
    clock = Scripted(spec_cost=2.0)  # 5 tokens in 2 plain steps' time: payoff 2.5
    clock.install(se, monkeypatch.setattr)
    _, m = run(se, [PROMPT], 60)
    assert clock.kinds == expected_kinds(len(clock.kinds), pays=True)
    assert m.gated_steps == 2 and m.spec_steps == len(clock.kinds) - 2


def test_a_probe_notices_that_speculation_became_cheap(spec_engine, monkeypatch):
    se = spec_engine(draft="full", k=4)
    clock = Scripted(spec_cost=lambda step: 10.0 if step < 4 else 0.5, probe_every=2)  # cheap after the start
    clock.install(se, monkeypatch.setattr)
    _, m = run(se, [PROMPT], 70)
    # EWMA of the speculative step time over the probes: 10, 8.1, 6.58, 5.36 (payoff 5 / 5.36 < 1), 4.39 (> 1);
    # the probe interval doubles after each probe that did not pay: 2 (the two measured plain steps), 4, 8, 16
    kinds = "".join(clock.kinds)
    head = "SSPP" + "S" + "P" * 4 + "S" + "P" * 8 + "S" + "P" * 16 + "S"
    assert kinds == head + "SS"  # 60 tokens in the head, then speculation pays: 2 steps of 5 tokens
    assert m.gated_steps == 30


def test_a_draft_too_slow_to_catch_up_is_not_probed_and_the_gate_outlives_a_run(spec_engine, monkeypatch):
    """Catching up costs 0.5 plain steps per missing position (> CATCH_UP_BUDGET): measured at the first speculative
    step (the prompt's catch-up), so the gate never probes; a second run on the same engine starts from what the
    first one measured."""
    se = spec_engine(draft="full", k=4)
    clock = Scripted(spec_cost=10.0, catch_cost=0.5)
    clock.install(se, monkeypatch.setattr)
    _, m = run(se, [PROMPT], 60)
    kinds = "".join(clock.kinds)
    assert kinds == "SSPP" + "P" * (len(kinds) - 4) and len(kinds) > 4 + PROBE_EVERY  # no probe
    assert m.speculation()["gate"]["catch_up_ms_per_position"] == pytest.approx(500.0)
    clock.kinds.clear()
    _, m2 = run(se, [PROMPT], 40)
    assert clock.kinds == ["P"] * 39 and m2.gated_steps == 39  # the first of the 40 tokens comes from the prompt


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_greedy_output_is_identical_with_the_gate_on_and_off(spec_engine, monkeypatch, mode):
    se = spec_engine(draft="layers1", k=3, mode=mode, batch_size=2)  # partial acceptance, two rows
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4]]
    off, m_off = run(se, prompts, 50, gate=False)
    assert m_off.plain_steps == 0 and m_off.gated_steps == 0  # ungated: every step speculates
    clock = Scripted(spec_cost=10.0, probe_every=4)  # gated, with probes: speculative and plain steps alternate
    clock.install(se, monkeypatch.setattr)
    on, m_on = run(se, prompts, 50)
    assert m_on.gated_steps >= 4 and "S" in clock.kinds[4:]
    ref, _ = generate_ids(se.target, prompts, 50, ignore_eos=True)
    assert [r.token_ids for r in on] == [r.token_ids for r in off] == [r.token_ids for r in ref]


def test_the_gate_leaves_prompt_lookup_and_plain_engines_alone(spec_engine):
    se = spec_engine(draft="full", k=2)
    r = runner_mod.Runner(se.target, options=RunOptions(speculation_gate=True))
    assert r.gate is None
    assert runner_mod.Runner(se, options=RunOptions(speculation_gate=True)).gate is se.gate  # the engine's own
    assert runner_mod.Runner(se).gate is None


def test_seeded_sampling_is_not_gated_and_stays_reproducible(spec_engine, monkeypatch):
    se = spec_engine(draft="layers1", k=3)
    seeded = SamplingConfig(temperature=0.9, top_k=20, seed=4)
    want, _ = run(se, [PROMPT], 30, gate=False, sampling=seeded)
    Scripted(spec_cost=10.0).install(se, monkeypatch.setattr)  # speculation "never pays"
    got, m = run(se, [PROMPT], 30, sampling=seeded)
    assert m.gated_steps == 0 and m.plain_steps == 0  # every step speculated, as without the gate
    assert got[0].token_ids == want[0].token_ids
    _, m_unseeded = run(se, [PROMPT], 30, sampling=SamplingConfig(temperature=0.9, top_k=20))
    assert m_unseeded.gated_steps > 0  # the same rule without a seed is gated
    _, m_greedy = run(se, [PROMPT], 30, sampling=SamplingConfig(seed=4))
    assert m_greedy.gated_steps > 0  # greedy draws nothing: gated whatever its seed (vLLM passes one along)
