"""Shared helpers of the tests that need a real vLLM (run by scripts/ci_vllm.sh in its own virtualenv).

`require_vllm()` skips with the reason when vLLM is absent (the main test environment has none) and fails loudly
when vLLM is there but the plugin's entry point is not installed. Servers are started on 127.0.0.1 in their own
process group (setsid) and always stopped in a finally block: SIGTERM, then SIGKILL of that group after a grace time.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 240
ENV = {"NEURON_INFER_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# tiny Llama whose head_dim (32) is one vLLM's CPU attention supports (so stock vLLM can run it as well)
TINY_VLLM = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 256}


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM is not installed in this environment (the plugin tests run in the venv of "
                    "scripts/ci_vllm.sh)", allow_module_level=True)
    names = {ep.name: ep.value for ep in md.entry_points(group="vllm.platform_plugins")}
    if names.get("neuron_infer") != "neuron_infer.vllm_plugin:register":
        pytest.fail("neuron-infer's vllm.platform_plugins entry point is not installed: add it to pyproject.toml "
                    "and reinstall (pip install -e .)", pytrace=False)


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENV, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(code: str, args: list[str], timeout: float, **env_extra: str) -> dict:
    """Run `code` (a Python script printing one JSON line prefixed RESULT:) in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env(**env_extra), start_new_session=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"script failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT:"):])


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class Server:
    """`python -m vllm.entrypoints.openai.api_server ...` on 127.0.0.1 in its own process group."""

    def __init__(self, model: Path, args: list[str], log: Path, **env_extra: str):
        """env_extra: environment overrides, e.g. NEURON_INFER_VLLM="0" for stock vLLM."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115  (closed in kill(), after the process is gone)
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env(**env_extra),
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"server not ready after {SERVER_START_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def terminate(self, grace_s: float = 30.0) -> tuple[int | None, float, bool]:
        """SIGTERM to the server process; return (exit code, seconds to exit, whether its group outlived it)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            rc = None
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # engine core / worker children exit right after the API server
        leftover = group_alive(self.proc.pid)
        self.kill()
        return rc, elapsed, leftover

    def kill(self) -> None:
        """Last resort (finally blocks): SIGKILL whatever is left of this server's own process group."""
        if group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log_file.close()
