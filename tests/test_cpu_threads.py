"""The thread policy: a pure decision from usable CPUs and other processes' load, and its inputs."""
import os

import pytest
import torch

from neuron_infer import cpu_threads
from neuron_infer.cpu_threads import CpuSample, choose_threads, others_busy, parse_proc_stat, usable_cpus
from neuron_infer.errors import ConfigError


@pytest.mark.parametrize("cpus, others, cap, expected", [
    (2, 0.0, None, 2),    # idle: every CPU
    (2, 0.2, None, 2),    # background noise below SLACK: keep both
    (2, 0.6, None, 1),    # a process keeping most of a CPU busy: give that CPU up
    (2, 1.0, None, 1),    # one CPU-bound competitor
    (2, 2.0, None, 1),    # everything busy: still one thread
    (1, 0.0, None, 1),
    (8, 3.0, None, 5),
    (8, 2.9, None, 5),    # 5.1 free + slack -> 5
    (8, 2.7, None, 5),    # 5.3 free + slack -> 5 (a thread is added only when its CPU is 75% free)
    (8, 0.0, 4, 4),       # a tensor-parallel rank never exceeds its share
    (8, 6.0, 4, 2),       # ... and shrinks below it under load
    (4, -0.3, None, 4),   # a negative estimate (clock skew) counts as idle
])
def test_choose_threads_takes_the_cpus_others_leave_free(cpus, others, cap, expected):
    assert choose_threads(cpus, others, cap) == expected


def test_choose_threads_slack_boundary():
    s = cpu_threads.SLACK
    assert choose_threads(2, s - 0.01) == 2
    assert choose_threads(2, s + 0.01) == 1
    with pytest.raises(ValueError, match="cpus=0"):
        choose_threads(0, 0.0)


def test_usable_cpus_affinity_and_cgroup_quota():
    assert usable_cpus({0, 1, 2, 3}, "max 100000") == 4
    assert usable_cpus({0, 1, 2, 3}, "150000 100000") == 2  # 1.5 CPUs of quota: two threads can use it
    assert usable_cpus({0, 1, 2, 3}, "100000 100000") == 1
    assert usable_cpus({5}, "800000 100000") == 1           # affinity is the tighter limit
    assert usable_cpus({0, 1}, "") == 2                      # no cgroup file
    assert usable_cpus({0, 1}, "garbage") == 2


def test_parse_proc_stat_counts_only_busy_time_of_our_cpus():
    hz = os.sysconf("SC_CLK_TCK")
    text = ("cpu  900 0 900 900 0 0 0 0 0 0\n"
            "cpu0 100 10 20 500 30 1 2 3 0 0\n"   # busy 100+10+20+1+2+3 = 136 (idle 500, iowait 30 not counted)
            "cpu1 200 0 0 400 0 0 0 0 0 0\n"      # busy 200
            "cpu2 999 0 0 0 0 0 0 0 0 0\n"        # not ours
            "intr 12345 1 2\nctxt 99\n")
    assert parse_proc_stat(text, {0, 1}) == pytest.approx(336 / hz)
    assert parse_proc_stat(text, {1}) == pytest.approx(200 / hz)


def test_others_busy_subtracts_our_own_cpu_time():
    before = CpuSample(busy_s=10.0, own_s=1.0, wall_s=100.0)
    after = CpuSample(busy_s=12.0, own_s=2.0, wall_s=101.0)  # 2 CPU-s busy in 1 s, 1 of them ours
    assert others_busy(before, after) == pytest.approx(1.0)
    assert others_busy(before, CpuSample(10.5, 2.0, 101.0)) == 0.0  # accounting skew never goes negative
    assert others_busy(before, before) == 0.0


def test_governor_follows_the_load(monkeypatch):
    """tick() re-samples after the period and sets torch's thread count from the new load."""
    readings = iter([CpuSample(0.0, 0.0, 0.0), CpuSample(0.0, 0.0, 1.0),      # start(): idle
                     CpuSample(2.0, 1.0, 2.0),                                  # a competitor appears
                     CpuSample(3.0, 2.0, 3.0)])                                 # it is gone
    monkeypatch.setattr(cpu_threads, "sample", lambda cpus: next(readings))
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda affinity: 2)
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)
    clock = iter([5.0, 5.0])
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: next(clock))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert cpu_threads.use("auto") == 2 and torch.get_num_threads() == 2
        cpu_threads.tick()
        assert torch.get_num_threads() == 1
        cpu_threads.tick()
        assert torch.get_num_threads() == 2
    finally:
        cpu_threads.use(before)


def test_fixed_counts_and_omp_num_threads_are_never_re_evaluated(monkeypatch):
    monkeypatch.setattr(cpu_threads, "sample", lambda cpus: pytest.fail("a fixed count must not sample the load"))
    before = torch.get_num_threads()
    try:
        assert cpu_threads.use(1) == 1 and torch.get_num_threads() == 1
        cpu_threads.tick()
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu_threads.use("auto") == 3
        assert cpu_threads.use("auto", cap=2) == 2
        cpu_threads.tick()
        for bad in (0, "fast", 1.5, True):
            with pytest.raises(ConfigError, match="must be an int >= 1 or 'auto'"):
                cpu_threads.use(bad)
    finally:
        cpu_threads.use(before)


def test_every_cpu_graph_call_lets_the_policy_re_evaluate(monkeypatch):
    from neuron_infer.backends.cpu.graph import LoadedGraph

    calls = []
    monkeypatch.setattr(cpu_threads, "tick", lambda: calls.append("tick"))
    graph = LoadedGraph(lambda *args: calls.append(args) or "logits", {}, "g")
    assert graph(1, 2) == "logits" and calls == ["tick", (1, 2)]  # re-evaluated before the graph runs
