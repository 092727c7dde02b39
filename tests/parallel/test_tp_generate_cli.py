"""TP generation as users run it: `neuron-infer generate ARTIFACTS` on a tp artifact, the long-lived rank group of
a loaded model (reused by every call, stopped by close / exit / the parent's death), a rank killed mid-generation or
between calls, and ranks joined through the torchrun environment over loopback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.compile.builder import compile_model
from neuron_infer.parallel.launch import RankFailure
from tests.parallel.test_launch import SLACK_S, rank_processes
from tests.parallel.test_tp_e2e import BUILD, SMOL_LIKE
from tests.tiny_checkpoint import write_tiny_checkpoint

QUIET = {"backend": "cpu-eager", "say": lambda m: None}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """SmolLM2-shaped tiny model (9 q / 3 kv heads): tp = 1 reference and tp = 2 (padding, boundary KV replica)."""
    root = tmp_path_factory.mktemp("tp_cli")
    ckpt = write_tiny_checkpoint(root / "ckpt", **SMOL_LIKE)
    for tp in (1, 2):
        compile_model(ckpt, root / f"tp{tp}", BUILD.replace(tp_degree=tp), **QUIET)
    return root


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert rank_processes() == [], "rank processes outlived generate"


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "neuron_infer.cli", "generate", *args], env=env or dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_generate_on_a_tp_artifact_matches_tp1(arts):
    ref = CompiledModel.load(arts / "tp1").generate([PROMPT], max_new_tokens=8, ignore_eos=True)
    proc = _cli(str(arts / "tp2"), "--prompt", PROMPT, "--max-new-tokens", "8", "--ignore-eos", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    d = json.loads(out)
    assert d["outputs"][0]["token_ids"] == ref.outputs[0].token_ids
    assert d["outputs"][0]["text"] == ref.outputs[0].text
    assert len(d["metrics"]["token_latencies_s"]) == 7 and d["metrics"]["ttft_s"] > 0


def test_a_loaded_tp_model_serves_every_call_on_the_ranks_started_at_load(arts):
    ref = CompiledModel.load(arts / "tp1")
    prompts = [[1, 5, 6, 7], [1, 17, 42, 99, 7]]
    with CompiledModel.load(arts / "tp2") as m:
        pids = m.group.pids
        assert len(set(pids)) == 2 and rank_processes_pids() == set(pids)  # started at load, before any call
        for p in prompts:
            out = m.generate_ids([p], max_new_tokens=6, ignore_eos=True)
            assert m.group.last_run["pids"] == pids  # the same processes, shards loaded once
            assert out.outputs[0].token_ids == ref.generate_ids([p], max_new_tokens=6, ignore_eos=True).outputs[0].token_ids
    assert rank_processes() == [] and not any(psutil.pid_exists(p) for p in pids)  # the with block closed them
    with pytest.raises(RankFailure, match="no longer running"):
        m.generate_ids([prompts[0]], max_new_tokens=2)


def test_a_rank_killed_between_calls_is_reported_on_the_next_call(arts):
    m = CompiledModel.load(arts / "tp2")
    m.generate_ids([[1, 5, 6, 7]], max_new_tokens=2)
    os.kill(m.group.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died: killed by signal SIGKILL") as info:
        m.generate_ids([[1, 5, 6, 7]], max_new_tokens=2)
    assert "all 2 rank processes were stopped" in str(info.value) and time.monotonic() - t0 < SLACK_S
    m.close()


_OWNER = """
import sys, time
from neuron_infer.api import CompiledModel
m = CompiledModel.load(sys.argv[1])
print(" ".join(map(str, m.group.pids)), flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)  # no close(): interpreter exit stops the ranks
time.sleep(600)  # killed by the test
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_ranks_end_with_the_process_that_loaded_them(arts, how):
    """Interpreter exit without close(), and SIGKILL of the owner (which can stop nothing): no rank survives."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(arts / "tp2"), how], stdout=subprocess.PIPE,
                             text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2
        if how == "sigkill":
            owner.kill()
        owner.wait(timeout=60)
        deadline = time.monotonic() + SLACK_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "rank processes outlived their owner"
    finally:
        owner.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rank_processes_pids() -> set[int]:
    return {p.pid for p in rank_processes()}


def test_killing_a_rank_mid_generation_fails_promptly_naming_it(arts):
    m = CompiledModel.load(arts / "tp2")
    killed = []

    def kill_rank1(rows):
        if not killed and len(rows[0]) == 2:  # two tokens out: rank 1 is busy decoding
            os.kill(m.group.last_run["pids"][1], signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(RankFailure) as info:
        m.generate_ids([[1, 5, 6, 7]], max_new_tokens=50, ignore_eos=True, on_tokens=kill_rank1)
    msg = str(info.value)
    assert killed and "rank 1 died: killed by signal SIGKILL" in msg and "all 2 rank processes were stopped" in msg
    assert time.monotonic() - killed[0] < SLACK_S  # bounded by the launcher's grace period, not the run timeout


@pytest.mark.slow
def test_torchrun_environment_ranks_generate_over_loopback(arts):
    """Two CLI processes join one gloo group through MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (as torchrun sets
    them, on one host or several); rank 0 prints the result, rank 1 prints nothing."""
    ref = CompiledModel.load(arts / "tp1").generate([PROMPT], max_new_tokens=6, ignore_eos=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_cli(str(arts / "tp2"), "--prompt", PROMPT, "--max-new-tokens", "6", "--ignore-eos", "--json",
                  env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert json.loads(outs[0][0])["outputs"][0]["token_ids"] == ref.outputs[0].token_ids
    assert outs[1][0].strip() == ""  # only rank 0 prints
