"""scripts/run_aws_nki_kernels.py's own logic, without any AWS checkout: case discovery, the two tolerance rules,
per-case status, and the kernel/case counting it reports. Synthetic kernels are written into a temporary
"checkout" and loaded through the runner's own loader."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _runner():
    spec = importlib.util.spec_from_file_location("run_aws_nki_kernels", SCRIPTS / "run_aws_nki_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # puts scripts/ on sys.path, so aws_nki_cases imports below
    return module


runner = _runner()
cases_mod = sys.modules["aws_nki_cases"]
lib_mod = importlib.import_module("aws_nkilib_cases")
Case = cases_mod.Case

KERNEL_FILE = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def add_one(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def sbuf_result(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t
'''


def _case(name, kernel, offset, repo="nki-library", same_as=""):
    """A case that runs `kernel` of the synthetic checkout on a 4x8 input and expects x + offset."""
    def run(root, load, rng):
        mod = load(root / "synthetic_kernels.py")
        x = rng.standard_normal((4, 8)).astype(np.float32)
        got = cases_mod.simulate(getattr(mod, kernel), x)
        lib_mod.check_max(got, x + offset, 1e-6, 1e-6, "output 0")
    return Case(f"{repo}/{name}", repo, run, f"{repo}/{same_as}" if same_as else "")


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "synthetic_kernels.py").write_text(KERNEL_FILE)
    return tmp_path


SYNTHETIC = [
    _case("add_one", "add_one", 1.0),
    _case("add_one_again", "add_one", 1.0, same_as="add_one"),
    _case("add_one_wrong_ref", "add_one", 2.0),
    _case("sbuf_result", "sbuf_result", 0.0),
    _case("add_one_sdk", "add_one", 1.0, repo="sdk"),
]


def test_counts_kernels_cases_and_statuses(checkout, capsys):
    status = runner.main(["--nki-library", str(checkout)], cases=SYNTHETIC)
    out = capsys.readouterr().out.splitlines()
    lines = {line.split()[1]: line.split()[0] for line in out if line.split()[1].startswith(("nki-", "sdk/"))}
    assert lines == {"nki-library/add_one": "ok", "nki-library/add_one_again": "ok",
                     "nki-library/add_one_wrong_ref": "FAIL", "nki-library/sbuf_result": "ERROR",
                     "sdk/add_one_sdk": "skip"}
    assert out[-2] == "summary: ERROR 1, FAIL 1, ok 2, skip 1"
    assert out[-1] == "kernels: 1 of 3 ran and matched (nki-library 1 of 3); cases: 2 of 4"
    assert status == 1


def test_a_kernel_with_one_failing_case_is_not_counted(checkout, capsys):
    broken_again = _case("add_one_broken", "add_one", 5.0, same_as="add_one")
    runner.main(["--nki-library", str(checkout)], cases=[SYNTHETIC[0], broken_again])
    assert capsys.readouterr().out.splitlines()[-1] == \
        "kernels: 0 of 1 ran and matched (nki-library 0 of 1); cases: 1 of 2"


def test_filter_selects_cases_and_a_clean_run_exits_0(checkout, capsys):
    status = runner.main(["--nki-library", str(checkout), "--sdk", str(checkout), "-k", "add_one"],
                         cases=SYNTHETIC[:2] + SYNTHETIC[3:])   # sbuf_result filtered out
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[-1] == "kernels: 2 of 2 ran and matched (sdk 1 of 1, nki-library 1 of 1); cases: 3 of 3"


def test_a_missing_checkout_is_one_error_line_and_status_2(tmp_path, capsys):
    status = runner.main(["--nki-library", str(tmp_path / "absent")], cases=SYNTHETIC)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: --nki-library")


def test_run_case_classifies_outcomes(checkout):
    roots = {"nki-library": checkout, "sdk": None}

    def raises(exc):
        def run(root, load, rng):
            raise exc
        return Case("nki-library/x", "nki-library", run)
    assert runner.run_case(raises(AssertionError("mismatch output 0: too far")), roots)[0] == "FAIL"
    status, detail = runner.run_case(raises(AssertionError("kernel_assert: bad shape")), roots)
    assert status == "ERROR" and "AssertionError" in detail
    status, detail = runner.run_case(raises(ValueError("boom")), roots)
    assert status == "ERROR" and detail.startswith("ValueError: boom (test_aws_runner.py:")
    assert runner.run_case(SYNTHETIC[4], roots) == ("skip", "no --sdk checkout given")


def test_library_rule_scales_atol_by_the_largest_reference_magnitude():
    """|got - ref| <= atol + rtol * max|ref|: an error allowed by the largest element is allowed everywhere."""
    ref = np.array([1.0, -4.0])
    lib_mod.check_max(ref + 0.40, ref, rtol=0.1, atol=0.01)       # bound 0.41
    with pytest.raises(AssertionError, match="mismatch"):
        lib_mod.check_max(ref + np.array([0.42, 0.0]), ref, rtol=0.1, atol=0.01)
    lib_mod.check_max(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), 0, 0)
    with pytest.raises(AssertionError, match="mismatch"):
        lib_mod.check_max(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 0, 0)


def test_library_rule_compares_equal_sized_layouts_and_rejects_other_sizes():
    ref = np.arange(6.0).reshape(2, 3)
    lib_mod.check_max(ref.reshape(3, 2), ref, 0, 0)
    with pytest.raises(AssertionError, match="mismatch .*shape"):
        lib_mod.check_max(np.zeros(5), ref, 1, 1)


def test_sdk_rule_is_elementwise_allclose_with_exact_shapes():
    ref = np.array([1.0, 100.0])
    cases_mod.check(ref + np.array([0.0, 0.5]), ref, rtol=1e-2, atol=0)
    with pytest.raises(AssertionError, match="mismatch"):
        cases_mod.check(ref + np.array([0.5, 0.0]), ref, rtol=1e-2, atol=0)   # 0.5 > 1e-2 * 1
    with pytest.raises(AssertionError, match="shape"):
        cases_mod.check(ref.reshape(2, 1), ref, 1, 1)


def test_discovered_cases_are_unique_and_grouped_within_their_repository():
    cases = cases_mod.all_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    for c in cases:
        assert c.repo in ("sdk", "nki-library") and c.name.startswith(c.repo + "/")
        assert c.kernel_name in names, f"{c.name} counts as {c.kernel_name}, which is no case"
    assert {"nki-library/allgather_sb2sb", "nki-library/fine_grained_allgather"} <= set(names)
