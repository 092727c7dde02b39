"""The notebooks: each committed notebook re-executed within its budget (slow), the harness on tiny synthetic
notebooks (fast), and the committed notebooks' structure (fast: metadata, outputs, public API only, anchors).

The slow tests call scripts/run_notebooks.py's own functions (not a copy) in --check mode, so the committed file is
never rewritten by the test suite. NEURON_INFER_NOTEBOOK_TIMEOUT_SCALE (default 1) multiplies every budget on a
slower machine.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
rn = importlib.util.module_from_spec(_SPEC)
sys.modules["run_notebooks"] = rn  # dataclasses resolve annotations through sys.modules
_SPEC.loader.exec_module(rn)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_IDS = [p.stem for p in NOTEBOOKS]
# `from neuron_infer.x import _y`, `from nki_kernels import _y, z`, `neuron_infer._x`, `nki_kernels.mlp._y`
_PRIVATE = re.compile(r"\bfrom\s+(neuron_infer|nki_kernels)(\.\w+)*\s+import\s+\(?[^\n]*?\b_\w"
                      r"|\b(neuron_infer|nki_kernels)(\.\w+)*\._\w")


def _write_nb(path: Path, sources: list[str], meta: dict | None) -> Path:
    """A notebook with one markdown title then one code cell per source; meta -> metadata['neuron_infer']."""
    nb = nbformat.v4.new_notebook()
    if meta is not None:
        nb.metadata["neuron_infer"] = meta
    nb.cells = [nbformat.v4.new_markdown_cell("# synthetic")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


# ---------------------------------------------------------------- slow: every committed notebook, --check mode
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_IDS)
def test_notebook_runs_within_budget(path):
    scale = float(os.environ.get("NEURON_INFER_NOTEBOOK_TIMEOUT_SCALE", "1"))
    before = path.read_bytes()
    result = rn.run_notebook(path, check=True, timeout_scale=scale)
    if result.status == "skipped":
        pytest.skip(result.message)
    assert result.status == "ok", result.message
    assert path.read_bytes() == before  # --check never writes


# ---------------------------------------------------------------- fast: the harness on synthetic notebooks
def test_ok_notebook_written_back_with_outputs_and_cwd(tmp_path):
    nb_dir = tmp_path / "nbs"
    nb_dir.mkdir()
    plot = "import matplotlib.pyplot as plt\nplt.plot([0, 1]); plt.xlabel('x (s)'); plt.show()"
    path = _write_nb(nb_dir / "ok.ipynb", ["import os; print(os.getcwd())", "import neuron_infer; print('imported')",
                                           "import sys; print(sys.executable)", plot],
                     {"budget_s": 60, "needs": []})
    result = rn.run_notebook(path)
    assert result.status == "ok", result.message
    assert result.wall_s > 0
    cells = nbformat.read(path, as_version=4).cells
    assert cells[1].outputs[0].text.strip() == str(nb_dir)  # cwd = the notebook's directory
    assert cells[2].outputs[0].text.strip() == "imported"  # this checkout is importable from there
    assert cells[3].outputs[0].text.strip() == sys.executable  # the kernel is this interpreter
    assert any("image/png" in o.get("data", {}) for o in cells[4].outputs)  # inline plots are captured


def test_check_mode_leaves_file_unchanged(tmp_path):
    path = _write_nb(tmp_path / "c.ipynb", ["print(1 + 1)"], {"budget_s": 60, "needs": []})
    before = path.read_bytes()
    assert rn.main(["--check", str(path)]) == 0
    assert path.read_bytes() == before
    path.chmod(0o644)
    assert rn.main([str(path)]) == 0  # the twin: without --check the output is written
    assert nbformat.read(path, as_version=4).cells[1].outputs[0].text == "2\n"
    assert path.stat().st_mode & 0o777 == 0o644  # the atomic rewrite keeps the file's permissions
    assert [p.name for p in tmp_path.iterdir()] == ["c.ipynb"]  # no temporary file left behind


def test_error_cell_fails_naming_notebook_and_cell(tmp_path, capsys):
    path = _write_nb(tmp_path / "err.ipynb", ["x = 1", "raise ValueError('boom-marker')", "print('never')"],
                     {"budget_s": 60, "needs": []})
    before = path.read_bytes()
    result = rn.run_notebook(path)
    assert result.status == "failed"
    assert "err.ipynb" in result.message and "cell 2" in result.message
    assert "ValueError" in result.message and "boom-marker" in result.message
    assert path.read_bytes() == before  # a failed run never rewrites the notebook
    assert rn.main([str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_budget_exceeded_fails_naming_budget(tmp_path):
    path = _write_nb(tmp_path / "slow.ipynb", ["import time; time.sleep(60)"], {"budget_s": 3, "needs": []})
    result = rn.run_notebook(path, check=True)
    assert result.status == "failed"
    assert "slow.ipynb" in result.message and "budget of 3 s" in result.message
    assert result.wall_s < 30  # stopped at the budget, not after the 60 s cell


def test_timeout_scale_multiplies_budget(tmp_path):
    path = _write_nb(tmp_path / "scaled.ipynb", ["import time; time.sleep(60)"], {"budget_s": 2, "needs": []})
    result = rn.run_notebook(path, check=True, timeout_scale=2.0)
    assert result.status == "failed" and "budget of 4 s" in result.message


def test_missing_metadata_is_a_clear_error(tmp_path):
    path = _write_nb(tmp_path / "nometa.ipynb", ["print(1)"], None)
    result = rn.run_notebook(path)
    assert result.status == "failed"
    assert "nometa.ipynb" in result.message and "metadata['neuron_infer']" in result.message
    assert "budget_s" in result.message  # says what to add


@pytest.mark.parametrize("meta, needle", [
    ({"budget_s": 0, "needs": []}, "positive int"),
    ({"budget_s": "60", "needs": []}, "positive int"),
    ({"budget_s": 60, "needs": ["gpu"]}, "needs"),
    ({"budget_s": 60, "needs": [], "budget": 3}, "unknown key"),
])
def test_bad_metadata_rejected(tmp_path, meta, needle):
    nb = nbformat.v4.new_notebook()
    nb.metadata["neuron_infer"] = meta
    with pytest.raises(rn.NotebookError, match=needle):
        rn.read_spec(nb, tmp_path / "x.ipynb")


def test_vllm_notebook_skipped_with_reason(tmp_path, monkeypatch):
    path = _write_nb(tmp_path / "v.ipynb", ["raise SystemExit('must not run')"], {"budget_s": 60, "needs": ["vllm"]})
    monkeypatch.delenv(rn.VLLM_PYTHON_ENV, raising=False)
    result = rn.run_notebook(path)
    assert result.status == "skipped" and rn.VLLM_PYTHON_ENV in result.message
    monkeypatch.setenv(rn.VLLM_PYTHON_ENV, str(tmp_path / "no-such-python"))
    assert rn.run_notebook(path).status == "skipped"
    if importlib.util.find_spec("vllm") is None:  # this interpreter: a python without vllm
        monkeypatch.setenv(rn.VLLM_PYTHON_ENV, sys.executable)
        result = rn.run_notebook(path)
        assert result.status == "skipped" and "cannot import vllm" in result.message


def test_list_prints_budgets_without_running(tmp_path, capsys):
    good = _write_nb(tmp_path / "a.ipynb", ["raise SystemExit('must not run')"], {"budget_s": 42, "needs": ["vllm"]})
    assert rn.main(["--list", str(good)]) == 0
    assert "a.ipynb  budget 42 s  needs ['vllm']" in capsys.readouterr().out
    bad = _write_nb(tmp_path / "b.ipynb", ["print(1)"], None)
    assert rn.main(["--list", str(good), str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out and nbformat.read(good, as_version=4).cells[1].outputs == []


def test_private_import_pattern():
    bad = ["from neuron_infer.parallel.plan import _kv_bytes", "import neuron_infer._x",
           "from nki_kernels.mlp import kernel, _helper", "x = neuron_infer.api._load(1)"]
    good = ["from neuron_infer.api import compile_model", "from nki_kernels.mlp import kernel",
            "import neuron_infer.parallel.plan as plan", "x = a._private  # not ours"]
    assert all(_PRIVATE.search(s) for s in bad)
    assert not any(_PRIVATE.search(s) for s in good)


# ---------------------------------------------------------------- fast: structure of the committed notebooks
def _text_of_outputs(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        for mime in ("text/markdown", "text/plain", "text/html"):
            parts.append(out.get("data", {}).get(mime, ""))
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_IDS)
def test_committed_notebook_structure(path):
    nb = nbformat.read(path, as_version=4)
    spec = rn.read_spec(nb, path)  # metadata present and valid
    assert spec.budget_s <= 600, f"{path.name}: budget_s {spec.budget_s} is more than the 10 min CI allows"
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code, f"{path.name} has no code cells"
    unexecuted = [i for i, c in enumerate(nb.cells) if c in code and c.get("execution_count") is None]
    assert not unexecuted, f"{path.name}: cells {unexecuted} have no committed outputs: run " \
                           f"scripts/run_notebooks.py {path.relative_to(ROOT)}"
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            assert not _PRIVATE.search(c.source), f"{path.name} cell {i} imports a private name"
            errors = [o for o in c.get("outputs", []) if o.get("output_type") == "error"]
            assert not errors, f"{path.name} cell {i} has a committed error output"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "published" in first.source.lower(), \
        f"{path.name} must open with a markdown cell quoting the published setup and result"
    everywhere = "\n".join(c.source + "\n" + _text_of_outputs(c) for c in nb.cells).lower()
    assert "published vs this run" in everywhere, f"{path.name} must close with a table 'published vs this run'"


def test_notebook_sizes_stay_small():
    big = {p.name: p.stat().st_size for p in NOTEBOOKS if p.stat().st_size > 400_000}
    assert not big, f"notebooks over 400 KB (shrink figures: figsize ~(6, 3.5), dpi 80): {big}"
