"""Execute the case-study notebooks within their time budgets (and write their outputs back).

    python scripts/run_notebooks.py notebooks/04_nki_kernels.ipynb            # run, write outputs in place
    python scripts/run_notebooks.py --check notebooks/*.ipynb                 # run, write nothing, report
    python scripts/run_notebooks.py --check --timeout-scale 2 notebooks/*.ipynb
    python scripts/run_notebooks.py --list notebooks/*.ipynb                  # budgets and needs, nothing run

Every notebook declares its budget in its notebook-level metadata:

    metadata["neuron_infer"] = {"budget_s": 180, "needs": []}      # "needs": ["vllm"] for the vLLM notebook

A notebook fails (exit status 1, one line naming the notebook, the cell and the budget) when a cell raises or when
the whole run exceeds budget_s * --timeout-scale. The kernel is this interpreter's ipykernel, started in the
notebook's directory with the repository root first on PYTHONPATH (the notebooks run against this checkout) and the
inline matplotlib backend. A notebook whose "needs" contains "vllm" runs only when NEURON_INFER_VLLM_PYTHON names a
python that can import vllm (the notebook starts vLLM with that python, e.g. as a server subprocess); otherwise it is
skipped with the reason printed. Without --check the executed notebook replaces the file atomically (temporary file
in the same directory + rename), which is how the committed outputs are produced.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError
from traitlets import default

REPO_ROOT = Path(__file__).resolve().parent.parent
KNOWN_NEEDS = frozenset({"vllm"})
VLLM_PYTHON_ENV = "NEURON_INFER_VLLM_PYTHON"
_KERNEL_NAME = "neuron-infer-python"


class NotebookError(Exception):
    """A notebook that cannot be run as declared (bad metadata, failing cell, budget exceeded)."""


@dataclass(frozen=True)
class NotebookSpec:
    """What a notebook declares in metadata["neuron_infer"]."""

    budget_s: int
    needs: tuple[str, ...]


@dataclass(frozen=True)
class RunResult:
    """Outcome of one notebook: status is "ok", "failed" or "skipped"; wall_s is 0 when skipped."""

    path: Path
    status: str
    wall_s: float
    message: str


def read_spec(nb: nbformat.NotebookNode, path: Path) -> NotebookSpec:
    """Parse metadata["neuron_infer"]; raise NotebookError naming the notebook and the fix when it is missing/bad."""
    fix = (f'add notebook-level metadata "neuron_infer": {{"budget_s": <int seconds>, "needs": []}} to {path} '
           '(jupytext header: `# jupyter: {neuron_infer: {budget_s: 120, needs: []}}`)')
    meta = nb.get("metadata", {}).get("neuron_infer")
    if not isinstance(meta, dict):
        raise NotebookError(f"{path}: no metadata['neuron_infer']: {fix}")
    unknown = set(meta) - {"budget_s", "needs"}
    if unknown:
        raise NotebookError(f"{path}: unknown key(s) {sorted(unknown)} in metadata['neuron_infer']: {fix}")
    budget, needs = meta.get("budget_s"), meta.get("needs", [])
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise NotebookError(f"{path}: metadata['neuron_infer']['budget_s'] must be a positive int, got {budget!r}")
    if not isinstance(needs, list) or not set(needs) <= KNOWN_NEEDS:
        raise NotebookError(f"{path}: metadata['neuron_infer']['needs'] must be a list drawn from "
                            f"{sorted(KNOWN_NEEDS)}, got {needs!r}")
    return NotebookSpec(budget_s=budget, needs=tuple(needs))


def skip_reason(spec: NotebookSpec) -> str | None:
    """Why this notebook cannot run in this environment (None: it can)."""
    if "vllm" not in spec.needs:
        return None
    py = os.environ.get(VLLM_PYTHON_ENV)
    if not py:
        return f"needs vllm: set {VLLM_PYTHON_ENV} to a python with vllm installed (scripts/ci_vllm.sh does)"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([py, "-c", probe], capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"needs vllm: {VLLM_PYTHON_ENV}={py} cannot be run ({exc})"
    return None if ok else f"needs vllm: {VLLM_PYTHON_ENV}={py} cannot import vllm"


def _kernel_manager_class(spec_dir: Path) -> type[AsyncKernelManager]:
    """A kernel manager class whose only kernel spec is this interpreter's ipykernel (not whatever 'python3' is)."""
    kdir = spec_dir / _KERNEL_NAME
    kdir.mkdir(parents=True, exist_ok=True)
    # log level ERROR: ipykernel warns on every start that the kernel listens on localhost TCP without encryption
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--log-level=ERROR"]
    (kdir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "neuron-infer", "language": "python"}))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir)], ensure_native_kernel=False)

    class ThisPythonKernelManager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _default_ksm(self) -> KernelSpecManager:
            return ksm

    return ThisPythonKernelManager


def _kernel_env() -> dict[str, str]:
    """Environment of the kernel: this checkout importable, inline plots, no thread oversubscription surprises."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


def _cell_label(nb: nbformat.NotebookNode, index: int) -> str:
    """'cell 7 (`first line of its source`)' for error messages."""
    first = next((ln.strip() for ln in nb.cells[index].source.splitlines() if ln.strip()), "")
    return f"cell {index} (`{first[:60]}`)"


def execute(nb: nbformat.NotebookNode, path: Path, budget_s: float) -> float:
    """Run every code cell of nb in place; return the wall time. Raise NotebookError on an error or overrun."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ni-kernelspec-") as spec_dir:
        client = NotebookClient(nb, kernel_manager_class=_kernel_manager_class(Path(spec_dir)), kernel_name=_KERNEL_NAME,
                                timeout=int(budget_s) + 1,
                                record_timing=False, resources={"metadata": {"path": str(path.parent)}})
        env = _kernel_env()
        with client.setup_kernel(env=env, cwd=str(path.parent)):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                remaining = budget_s - (time.monotonic() - t0)
                if remaining <= 0:
                    raise NotebookError(f"{path}: budget of {budget_s:.0f} s exceeded before {_cell_label(nb, index)}")
                client.timeout = max(1, int(remaining + 0.999))
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    raise NotebookError(f"{path}: {_cell_label(nb, index)} was still running when the budget of "
                                        f"{budget_s:.0f} s ran out (raise budget_s in the notebook metadata or "
                                        "make the cell faster)") from None
                except CellExecutionError as exc:
                    ename = getattr(exc, "ename", "error")
                    evalue = getattr(exc, "evalue", "")
                    raise NotebookError(f"{path}: {_cell_label(nb, index)} raised {ename}: {evalue} "
                                        f"(budget {budget_s:.0f} s)") from None
    wall = time.monotonic() - t0
    if wall > budget_s:
        raise NotebookError(f"{path}: took {wall:.1f} s, over its budget of {budget_s:.0f} s")
    return wall


def write_atomic(nb: nbformat.NotebookNode, path: Path) -> None:
    """Replace path with nb: write a temporary file next to it, then rename (never a half-written notebook)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:  # mkstemp creates 0600: keep the notebook's own permissions
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_notebook(path: Path | str, check: bool = False, timeout_scale: float = 1.0) -> RunResult:
    """Run one notebook within budget_s * timeout_scale; without check, write the outputs back in place."""
    path = Path(path).resolve()
    try:
        nb = nbformat.read(path, as_version=4)
        spec = read_spec(nb, path)
    except (OSError, ValueError, NotebookError) as exc:  # nbformat raises ValueError subclasses on bad JSON
        return RunResult(path, "failed", 0.0, str(exc))
    reason = skip_reason(spec)
    if reason:
        return RunResult(path, "skipped", 0.0, f"{path.name}: skipped: {reason}")
    budget = spec.budget_s * timeout_scale
    t0 = time.monotonic()
    try:
        wall = execute(nb, path, budget)
    except NotebookError as exc:
        return RunResult(path, "failed", time.monotonic() - t0, str(exc))
    if not check:
        write_atomic(nb, path)
    return RunResult(path, "ok", wall, f"{path.name}: ok in {wall:.1f} s (budget {budget:.0f} s)"
                     + ("" if check else ", outputs written"))


def list_specs(paths: list[Path]) -> int:
    """Print `name  budget_s  needs` per notebook; 1 when any metadata is missing or invalid."""
    bad = 0
    for path in paths:
        try:
            spec = read_spec(nbformat.read(path, as_version=4), path)
            print(f"{path.name}  budget {spec.budget_s} s  needs {list(spec.needs)}")
        except (OSError, ValueError, NotebookError) as exc:
            print(f"FAIL {exc}")
            bad += 1
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 when every notebook ran (or was skipped with a reason), 1 when any failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="execute but write nothing back")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every budget (slow machines)")
    ap.add_argument("--list", action="store_true", help="print each notebook's budget and needs, run nothing")
    args = ap.parse_args(argv)
    if args.timeout_scale <= 0:
        ap.error("--timeout-scale must be > 0")
    if args.list:
        return list_specs(args.notebooks)
    failed = 0
    for path in args.notebooks:
        result = run_notebook(path, check=args.check, timeout_scale=args.timeout_scale)
        if result.status == "failed":
            print(f"FAIL {result.message} [wall {result.wall_s:.1f} s]", flush=True)
        else:
            print(result.message, flush=True)
        failed += result.status == "failed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
