"""TP generation as users run it: `neuron-infer generate ARTIFACTS` on a tp artifact, a rank killed
mid-generation, and ranks joined through the torchrun environment over loopback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

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
