"""`import nki_kernels` resolves `nki` to a genuine package when present, else registers the simulator.
Each case runs in a fresh interpreter with fake `nki` distributions on PYTHONPATH."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = textwrap.dedent("""
    import sys
    import nki_kernels
    import nki, nki.language as nl, nki.isa as nisa
    print(nki_kernels.NKI_BACKEND, getattr(nki, "_IS_NKI_KERNELS_SIMULATOR", False), "torch" in sys.modules,
          sorted(m for m in sys.modules if m == "nki" or m.startswith("nki.")))
""")


def _fake_dist(root: Path, version: str, summary: str, init: str, submodules=()) -> None:
    pkg = root / "nki"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    for sub in submodules:
        (pkg / f"{sub}.py").write_text("")
    info = root / f"nki-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nki\nVersion: {version}\nSummary: {summary}\n")


def _probe(extra_path: Path | None, **env_vars) -> list[str]:
    env = dict(os.environ, **env_vars)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path) if extra_path else "", str(REPO)) if p)
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=REPO,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout.split(maxsplit=3)


def test_without_nki_the_simulator_is_registered_and_torch_is_not_imported():
    backend, is_sim, torch_loaded, modules = _probe(None)
    assert (backend, is_sim, torch_loaded) == ("simulator", "True", "False")
    for name in ("nki", "nki.language", "nki.isa", "nki.simulator", "nki.typing", "nki.compiler", "nki.collectives"):
        assert repr(name) in modules


@pytest.mark.parametrize("version,summary,init", [
    ("0.0.1", "WRONG PACKAGE", ""),                                    # the PyPI placeholder
    ("1.0.0", "A package", "raise ImportError('WRONG PACKAGE: install from the Neuron repository')"),
    ("1.0.0", "A package", "x = 1\n"),                                  # importable but no jit / isa
])
def test_placeholder_nki_is_detected_and_not_used(tmp_path, version, summary, init):
    _fake_dist(tmp_path, version, summary, init)
    backend, is_sim, _, _ = _probe(tmp_path)
    assert (backend, is_sim) == ("simulator", "True")


def test_genuine_nki_is_left_alone(tmp_path):
    _fake_dist(tmp_path, "0.6.0", "Neuron Kernel Interface", "def jit(fn=None, **kw):\n    return fn\n",
               submodules=("language", "isa"))
    backend, is_sim, _, modules = _probe(tmp_path)
    assert (backend, is_sim) == ("neuron", "False")
    assert "'nki.simulator'" not in modules


def test_force_simulator_env_overrides_a_genuine_nki(tmp_path):
    _fake_dist(tmp_path, "0.6.0", "Neuron Kernel Interface", "def jit(fn=None, **kw):\n    return fn\n",
               submodules=("language", "isa"))
    backend, is_sim, _, _ = _probe(tmp_path, NKI_KERNELS_FORCE_SIMULATOR="1")
    assert (backend, is_sim) == ("simulator", "True")
