"""The first run (`make demo`): progress on stderr (bars on a terminal, lines with elapsed time and ETA elsewhere,
nothing under --json), no third-party warnings a user cannot act on, no avoidable work before the first token or
after the last one, and an install that takes runtime dependencies only.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from neuron_infer import progress
from neuron_infer.api import compile_model
from neuron_infer.artifact.plan import planned_graphs
from neuron_infer.presets import load_preset

REPO = Path(__file__).resolve().parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def tiny_compile(tiny_dirs, out: Path, say) -> None:
    compile_model(tiny_dirs("gqa"), out, load_preset("tiny").build, backend="cpu-eager", say=say)


def test_compile_lines_carry_elapsed_time_and_eta(tiny_dirs, tmp_path):
    lines: list[str] = []
    tiny_compile(tiny_dirs, tmp_path / "art", lines.append)
    steps = [ln for ln in lines if ln.startswith("[")]
    pattern = re.compile(r"\[(\d+)/(\d+)\] compiling \S+ \(cpu-eager\) \((\d+:\d\d) elapsed(, ETA \d+:\d\d)?\)")
    matches = [pattern.fullmatch(ln) for ln in steps]
    n = len(planned_graphs(load_preset("tiny").build))  # every graph the tiny preset compiles
    assert n >= 3 and len(steps) == n and all(matches), steps
    assert [int(m.group(2)) for m in matches] == [n] * n
    assert [bool(m.group(4)) for m in matches] == [False] + [True] * (n - 1), "an ETA once a step has finished"


def test_a_terminal_gets_a_bar_instead_of_lines(tiny_dirs, tmp_path, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    lines: list[str] = []
    tiny_compile(tiny_dirs, tmp_path / "art", lines.append)
    assert not [ln for ln in lines if ln.startswith("[")], lines
    bar = term.getvalue()
    n = len(planned_graphs(load_preset("tiny").build))
    assert "compiling" in bar and f"{n}/{n}" in bar and "graph" in bar, bar


def test_bars_can_be_turned_off(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(progress, "_bars_allowed", True)
    progress.set_bars(False)
    lines: list[str] = []
    assert list(progress.steps([1, 2], "doing", lines.append)) == [1, 2]
    assert term.getvalue() == "" and len(lines) == 2


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("first-run") / "art"
    tiny_compile(tiny_dirs, out, lambda m: None)
    return out


@pytest.mark.parametrize("as_json", [False, True])
def test_loading_shows_a_bar_on_a_terminal_but_not_under_json(artifact, monkeypatch, as_json):
    from neuron_infer.cli import main

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(progress, "_bars_allowed", True)
    with pytest.raises(SystemExit) as e:
        main(["generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2", *(["--json"] if as_json else [])])
        raise SystemExit(0)
    assert e.value.code == 0
    assert ("loading" in term.getvalue()) is not as_json, term.getvalue()


def test_conversion_reports_each_stage(tmp_path, monkeypatch):
    from neuron_infer import embedded

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def fake_convert(path, out, gguf_sha256=None, stage=lambda s: None):
        for name in embedded.CONVERSION_STAGES:
            stage(name)
        for f in embedded._REQUIRED_FILES:
            (out / f).write_text("{}")

    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)
    lines: list[str] = []
    embedded.default_model_dir(cache=tmp_path / "cache", log=lines.append)
    staged = [ln.split(": ", 1)[1].rsplit(" (", 1)[0] for ln in lines if ln.startswith("converting: ")]
    assert staged == list(embedded.CONVERSION_STAGES), lines


def test_conversion_hides_transformers_gguf_bar(tmp_path, monkeypatch, capsys):
    """transformers' GGUF loader draws its own tqdm bar whatever its logging says; ours replace it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from neuron_infer import embedded

    def fake_convert(*a):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass

    monkeypatch.setattr(embedded, "_convert", fake_convert)
    real = gguf_utils.tqdm
    embedded.convert_gguf(tmp_path / "m.gguf", tmp_path)
    assert "de-quantizing" not in capsys.readouterr().err
    assert gguf_utils.tqdm is real, "restored afterwards"


@pytest.fixture(scope="module")
def cpu_package(tmp_path_factory):
    """One small AOTInductor graph compiled by the CPU backend, with the warnings raised while compiling."""
    from neuron_infer.backends.cpu.graph import CpuBackend

    out = tmp_path_factory.mktemp("cpu-graph")
    module = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CpuBackend().compile_graph(module, (torch.randn(2, 8),), out, "g")
    return out, caught


def test_compiling_shows_no_torch_internal_future_warning(cpu_package):
    _, caught = cpu_package
    shown = [w for w in caught if issubclass(w.category, FutureWarning)]  # shown by Python's default filters
    assert not shown, [str(w.message)[:100] for w in shown]


def _spawned_while_loading(package: Path, sha256: str, through_backend: bool) -> int:
    """Child processes started while loading one graph in a fresh interpreter (torch caches its probes per process)."""
    load = (f"from neuron_infer.backends.cpu.graph import _load_package; _load_package(Path({str(package)!r}), {sha256!r})"
            if through_backend else f"import torch; torch._inductor.aoti_load_package({str(package)!r})")
    code = f"""
import subprocess
from pathlib import Path
spawned = []
real = subprocess.Popen.__init__
def counting(self, args, *a, **k):
    spawned.append(args)
    return real(self, args, *a, **k)
subprocess.Popen.__init__ = counting
{load}
print(len(spawned))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_loading_a_graph_skips_torchs_isa_build_probes(cpu_package):
    """Plain aoti_load_package compiles and dlopens a probe per vector ISA (g++ and a child Python each) to fill in
    metadata it only compares; the backend's load tells torch the ISAs the CPU flags list are usable."""
    out, _ = cpu_package
    sha = json.loads((out / "g.json").read_text())["package_sha256"]
    plain = _spawned_while_loading(out / "g.pt2", sha, through_backend=False)
    ours = _spawned_while_loading(out / "g.pt2", sha, through_backend=True)
    assert ours < plain, (ours, plain)


def test_a_meta_model_does_not_import_the_symbolic_shape_stack():
    code = """
import sys
from neuron_infer.artifact.weights import empty_model
from neuron_infer.config import BuildConfig
from neuron_infer.capacity.presets import MODEL_PRESETS
empty_model(MODEL_PRESETS["llama-3.1-8b"], BuildConfig())
print(sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_the_console_script_freezes_the_heap_before_exit(monkeypatch, capsys):
    import gc

    from neuron_infer import cli

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(sys, "argv", ["neuron-infer", "--version"])
    cli.run()
    assert frozen and "version" in capsys.readouterr().out
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["neuron-infer"] == "neuron_infer.cli:run"


def test_demo_installs_runtime_dependencies_only():
    make = (REPO / "Makefile").read_text()
    rule = re.search(r"^demo: (\S+)", make, re.MULTILINE).group(1)
    target = re.search(rf"^{re.escape(rule)}: (\S+)", make, re.MULTILINE).group(1)
    recipe = make.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    assert "pip install" in recipe and "[dev]" not in recipe, recipe
    torch_line = next(ln for ln in recipe.splitlines() if "$(TORCH)" in ln)
    assert "--index-url $(TORCH_INDEX)" in torch_line
    assert re.search(r"^TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", make, re.MULTILINE)
    assert re.search(r"^TORCH := torch==[\d.]+\+cpu$", make, re.MULTILINE), "the CPU build, never a CUDA one"


def test_pyproject_uses_the_spdx_license_string():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    setuptools_req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(setuptools_req.split(">=")[1].split(".")[0]) >= 77  # PEP 639 license strings
    assert any(d.startswith("tqdm") for d in meta["project"]["dependencies"])
