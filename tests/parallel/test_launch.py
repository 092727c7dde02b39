"""The CPU rank launcher: collectives across real gloo ranks, and bounded, named, orphan-free failures.

Each spawned run costs ~2-4 s here (every rank imports torch), so the suite keeps to a handful of runs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from neuron_infer.errors import ConfigError
from neuron_infer.parallel.launch import (
    RankFailure,
    RankProcesses,
    all_gather_last_dim,
    all_reduce_sum,
    broadcast_from_rank0,
    check_cpu_ranks,
    rank_cpu_groups,
    rank_threads,
    run_ranks,
)
from tests.parallel import toy_workers as tw

# Failure must arrive within the run's timeout plus process start/stop slack: this is the functional "bounded
# failure" requirement (a regression would hang until pytest's own timeout), not a performance threshold.
SLACK_S = 30.0


def rank_processes() -> list[psutil.Process]:
    """Live spawned rank processes that are children of this test process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any("spawn_main" in a for a in p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert rank_processes() == [], "rank processes outlived run_ranks"


def test_collectives_over_three_ranks():
    emitted = []
    out = run_ranks(tw.collectives, 3, (4,), timeout_s=120, on_emit=emitted.append)
    assert out["rank"] == 0 and out["world"] == 3
    assert torch.equal(out["sum"], torch.arange(4, dtype=torch.float32) * 6)  # 1 + 2 + 3
    assert out["half"].dtype == torch.bfloat16 and torch.equal(out["half"], torch.full((3,), 3.0, dtype=torch.bfloat16))
    assert torch.equal(out["gathered"], torch.tensor([[0.0, 0, 1, 1, 2, 2]] * 2))  # rank order along the last dim
    assert out["token"].tolist() == [100] and out["obj"] == {"from": 0}
    assert emitted == [("hello from rank", 0)]
    assert 1 <= out["threads"] <= rank_threads(3)  # its share of the CPUs, fewer while others keep them busy


def test_single_rank_runs_in_process_with_identity_collectives():
    out = run_ranks(tw.collectives, 1, (3,), timeout_s=10)
    assert out["world"] == 1 and torch.equal(out["sum"], torch.arange(3, dtype=torch.float32))
    x = torch.ones(2)
    assert all_reduce_sum(x) is x and all_gather_last_dim(x) is x and broadcast_from_rank0(x) is x


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(tw.raise_on, 2, (1,), timeout_s=60)
    msg = str(info.value)
    assert "rank 1 raised ValueError: boom on rank 1" in msg and "toy_workers.py" in msg
    assert "rank 0 raised" not in msg  # rank 0 only lost its peer: reported as secondary
    assert time.monotonic() - t0 < 60 + SLACK_S


def test_a_hung_rank_is_named_and_killed_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 hung: no result within timeout_s=4 s") as info:
        run_ranks(tw.hang_on, 2, (1, 120.0), timeout_s=4)
    assert "rank(s) 0 were waiting for it" in str(info.value)
    assert time.monotonic() - t0 < 4 + SLACK_S


def test_a_rank_killed_with_sigkill_mid_run():
    """The parent kills rank 1 from outside while the ranks loop over all-reduces."""
    pids: list[int] = []

    def kill_rank1(msg):
        pids.extend(msg)
        os.kill(msg[1], 9)

    with pytest.raises(RankFailure, match="rank 1 died: killed by signal SIGKILL") as info:
        run_ranks(tw.report_pids_then_loop, 2, (400,), timeout_s=60, on_emit=kill_rank1)
    assert "all 2 rank processes were stopped" in str(info.value)
    assert len(pids) == 2 and not any(psutil.pid_exists(p) for p in pids)


def test_a_long_lived_group_serves_every_call_on_the_same_processes():
    group = RankProcesses(tw.serve_sums, 2, timeout_s=60, start_timeout_s=180)
    try:
        first, second = group.call({"x": 1}), group.call({"x": 2})
        assert first == {"sum": 3.0, "pids": group.pids} and second == {"sum": 6.0, "pids": group.pids}
    finally:
        group.close()
    assert not any(psutil.pid_exists(p) for p in group.pids)
    with pytest.raises(RankFailure, match="no longer running"):
        group.call({"x": 1})


def test_a_rank_hung_in_a_later_call_is_named_within_the_timeout():
    group = RankProcesses(tw.serve_sums, 2, timeout_s=4, start_timeout_s=180)
    assert group.call({"x": 1})["sum"] == 3.0
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 hung: no result within timeout_s=4 s"):
        group.call({"x": 1, "hang_rank": 1, "sleep_s": 120.0})
    assert time.monotonic() - t0 < 4 + SLACK_S
    with pytest.raises(RankFailure, match=r"no longer running \(stopped after a failure: rank 1 hung"):
        group.call({"x": 1})


@pytest.mark.parametrize("tp", [0, -1, True])
def test_invalid_degrees_fail_before_any_process_starts(tp):
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        run_ranks(tw.collectives, tp, (1,))


def test_rank_cpu_groups_split_contiguously_and_never_leave_a_rank_empty():
    assert rank_cpu_groups([1, 0], 2) == [[0], [1]]
    assert rank_cpu_groups(list(range(8)), 3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert rank_cpu_groups([0, 1], 4) == [[0], [0], [1], [1]]  # oversubscribed: every rank still gets a CPU
    with pytest.raises(ConfigError, match="cannot split 2 CPUs over 0 ranks"):
        rank_cpu_groups([0, 1], 0)


def test_rank_threads_divide_the_usable_cpus(monkeypatch):
    from neuron_infer.parallel import launch

    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    assert [rank_threads(tp) for tp in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_cpu_capacity_checks():
    with pytest.raises(ConfigError, match=r"--tp-degree <= 8"):
        check_cpu_ranks(9, cpu_count=2, available_bytes=2**40)
    with pytest.raises(ConfigError, match="GiB of host RAM"):
        check_cpu_ranks(4, weight_bytes_per_rank=2**30, cpu_count=2, available_bytes=2**32)
    check_cpu_ranks(4, weight_bytes_per_rank=2**20, cpu_count=2, available_bytes=2**32)  # fits: no error


_TORCHRUN_CHILD = """
import json, sys
import torch
sys.path.insert(0, {root!r})
from neuron_infer.parallel.launch import run_ranks
from tests.parallel import toy_workers as tw
out = run_ranks(tw.collectives, 2, (3,), timeout_s=60)
print(json.dumps({{"rank": out["rank"], "sum": out["sum"].tolist(), "gathered": out["gathered"].tolist(),
                   "token": out["token"].tolist(), "world": out["world"]}}))
"""


def test_torchrun_environment_joins_the_group_instead_of_spawning():
    """Two `python -c` processes with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set, over loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _TORCHRUN_CHILD.format(root=root)
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert [g["rank"] for g in got] == [0, 1] and all(g["world"] == 2 for g in got)
    for g in got:
        assert g["sum"] == [0.0, 3.0, 6.0] and g["gathered"] == [[0.0, 0.0, 1.0, 1.0]] * 2 and g["token"] == [100]


def test_a_rank_that_exits_cleanly_without_a_result_is_reported():
    with pytest.raises(RankFailure, match="rank 1 died: exited with code 0"):
        run_ranks(tw.exit0_on, 2, (1,), timeout_s=60)


def test_ranks_that_never_join_fail_after_the_start_timeout():
    with pytest.raises(RankFailure, match=r"rank\(s\) 0, 1 did not join the process group within start_timeout_s"):
        run_ranks(tw.collectives, 2, (1,), timeout_s=60, start_timeout_s=0.2)
