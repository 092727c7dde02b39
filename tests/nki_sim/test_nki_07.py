"""NKI 0.7 (Neuron SDK 2.33) on the simulator, next to 0.6: the documented 0.7 examples (NkiScalar arithmetic,
scalar_load / scalar_store, fori_loop over a runtime bound with the scalar as a scalar_offset, while_loop), the
constructs 0.7 removed, the LNC check (NCC_EVRF066), and the 0.7 API table.

The examples follow the 2.33 API reference pages (nki.isa.NkiScalar, nki.isa.scalar_load, nki.isa.scalar_store,
nki.language.fori_loop, nki.language.while_loop) and the "NKI Scalar Values" deep dive; each is compared with a
NumPy reference."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

import nki_kernels  # noqa: F401
from nki_kernels.sim import real_api
from nki_kernels.sim.errors import SimulationError

from .conftest import hbm_out, run


@pytest.fixture(params=[None, "0.7"], ids=["both-apis", "0.7-rules"])
def api07(request, monkeypatch):
    """The 0.7 examples run with both APIs accepted (the default) and under the strict 0.7 rules."""
    monkeypatch.delenv("NKI_COMPILER_FRONTEND", raising=False)
    if request.param is None:
        monkeypatch.delenv("NKI_SIMULATOR_API", raising=False)
    else:
        monkeypatch.setenv("NKI_SIMULATOR_API", request.param)
    return request.param


def scalar_arithmetic(index):
    tile = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=index)
    i = nisa.scalar_load(tile)
    i = i * 4 + 1
    res = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.scalar_store(res, i)
    return hbm_out(res)


def test_scalar_arithmetic_example(api07):
    out = run(scalar_arithmetic, np.array([[5]], np.int32))
    assert out[0, 0] == 5 * 4 + 1


def gather_rows(src, count):
    """fori_loop over a runtime upper bound: row i of src -> row i of out through scalar_offset = i."""
    rows, cols = src.shape
    out = nl.ndarray((rows, cols), dtype=src.dtype, buffer=nl.shared_hbm)
    n_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=count)
    n = nisa.scalar_load(n_sb)
    row = nl.ndarray((1, cols), dtype=src.dtype, buffer=nl.sbuf)
    nisa.memset(dst=row, value=0.0)
    for r in range(rows):
        nisa.dma_copy(dst=out[r:r + 1, :], src=row)

    def body(i):
        nisa.dma_copy(dst=row, src=src.ap([[cols, 1], [1, cols]], scalar_offset=i))
        nisa.dma_copy(dst=out.ap([[cols, 1], [1, cols]], scalar_offset=i), src=row)

    nl.fori_loop(0, n, body)
    return out


def test_fori_loop_with_a_scalar_bound_and_scalar_offsets(api07, rng):
    src = rng.standard_normal((6, 8)).astype(np.float32)
    out = run(gather_rows, src, np.array([[4]], np.int32))
    expected = np.zeros_like(src)
    expected[:4] = src[:4]
    np.testing.assert_array_equal(out, expected)


def test_fori_loop_body_value_follows_the_api(monkeypatch):
    seen = []

    def kernel(bound_reg):
        nl.fori_loop(0, 2, lambda i: seen.append(type(i).__name__))
        reg = nisa.register_alloc(2)
        nl.fori_loop(0, reg, lambda i: seen.append(type(i).__name__))

    monkeypatch.setenv("NKI_SIMULATOR_API", "0.7")
    run(kernel, None)
    assert seen == ["NkiScalar"] * 2 + ["VirtualRegister"] * 2   # "NkiScalar unless a bound is a VirtualRegister"
    seen.clear()
    monkeypatch.setenv("NKI_SIMULATOR_API", "0.6")
    run(kernel, None)
    assert seen == ["VirtualRegister"] * 4


def count_down(count):
    """while_loop: add 1 per iteration while the register (a countdown) is nonzero."""
    acc = nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    one = nl.ones((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    left = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=left, src=count)
    ione = nl.ones((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    reg = nisa.register_alloc()
    nisa.register_load(reg, left)

    def body(r):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
        nisa.tensor_tensor(dst=left, data1=left, data2=ione, op=nl.subtract)
        nxt = nisa.register_alloc()
        nisa.register_load(nxt, left)
        return nxt

    nl.while_loop(reg, body)
    return hbm_out(acc)


@pytest.mark.parametrize("version", [None, "0.6", "0.7"])
def test_while_loop_runs_under_both_apis(version, monkeypatch):
    if version:
        monkeypatch.setenv("NKI_SIMULATOR_API", version)
    assert run(count_down, np.array([[3]], np.int32))[0, 0] == 3
    assert run(count_down, np.array([[0]], np.int32))[0, 0] == 0   # a true while: zero runs no iteration


def test_scalar_width_rules(monkeypatch):
    monkeypatch.delenv("NKI_SIMULATOR_API", raising=False)

    def kernel(a32, a64):
        t32 = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t32, src=a32)
        x = nisa.scalar_load(t32)
        wrapped = x * x                                   # 100000 * 100000 wraps at 32 bits
        res = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.scalar_store(res, wrapped)
        return hbm_out(res)

    out = run(kernel, np.array([[100000]], np.int32), None)
    assert out[0, 0] == 1410065408
    assert (nisa.NkiScalar(2**31 - 1, nl.int32) + 1).value == -2**31
    big = nisa.NkiScalar(2**40, "int64")     # nl.int64 tiles are not simulated (FIDELITY.md); the scalar rules are
    assert (big * 4).value == 2**42
    with pytest.raises(SimulationError, match="rejected at nl.int64"):
        big < 3   # noqa: B015
    with pytest.raises(SimulationError, match="cannot be used"):
        (nisa.NkiScalar(1) < 2).value   # noqa: B018
    with pytest.raises(SimulationError, match="same dtype"):
        big + nisa.NkiScalar(1)
    with pytest.raises(SimulationError, match="no Python truth value"):
        bool(nisa.NkiScalar(1))


@pytest.mark.parametrize("case,fragment", [
    ("store_int", "must be an NkiScalar"),
    ("load_unsigned", "unsigned dtypes are not accepted"),
    ("bound_int64", "must be 32-bit"),
    ("onchip_offset_int64", "SBUF/PSUM scalar_offset must be an nl.int32 scalar"),
])
def test_scalar_misuse_raises(case, fragment, monkeypatch):
    monkeypatch.delenv("NKI_SIMULATOR_API", raising=False)

    def kernel():
        t32 = nl.zeros((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        if case == "store_int":
            nisa.scalar_store(t32, 3)
        elif case == "load_unsigned":
            nisa.scalar_load(nl.zeros((1, 1), dtype=nl.uint32, buffer=nl.sbuf))
        elif case == "bound_int64":
            nl.fori_loop(0, nisa.NkiScalar(4, "int64"), lambda i: None)
        else:
            t = nl.zeros((4, 8), dtype=nl.float32, buffer=nl.sbuf)
            t.ap([[8, 1], [1, 8]], scalar_offset=nisa.NkiScalar(1, "int64"))

    with pytest.raises(SimulationError, match=fragment):
        run(kernel)


def legacy_loops(count):
    """A 0.6 kernel: nl.dynamic_range over a register, then while on a register."""
    acc = nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    one = nl.ones((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    c = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c, src=count)
    reg = nisa.register_alloc()
    nisa.register_load(reg, c)
    for _ in nl.dynamic_range(reg):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
    ione = nl.ones((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    while reg:
        nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
        nisa.tensor_tensor(dst=c, data1=c, data2=ione, op=nl.subtract)
        nisa.register_load(reg, c)
    return hbm_out(acc)


@pytest.mark.parametrize("env", [{}, {"NKI_SIMULATOR_API": "0.6"}, {"NKI_COMPILER_FRONTEND": "custom"}])
def test_0_6_loops_still_run(env, monkeypatch):
    monkeypatch.delenv("NKI_SIMULATOR_API", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert run(legacy_loops, np.array([[3]], np.int32))[0, 0] == 6


def test_0_7_rules_reject_the_removed_loops(monkeypatch):
    monkeypatch.setenv("NKI_SIMULATOR_API", "0.7")
    with pytest.raises(SimulationError, match="nl.dynamic_range was removed in NKI 0.7"):
        run(legacy_loops, np.array([[3]], np.int32))

    def while_only():
        reg = nisa.register_alloc(1)
        while reg:
            break

    with pytest.raises(SimulationError, match="while on a VirtualRegister was removed"):
        run(while_only)


def test_0_6_rules_reject_scalars_and_bad_settings(monkeypatch):
    monkeypatch.setenv("NKI_SIMULATOR_API", "0.6")
    with pytest.raises(SimulationError, match="needs NKI 0.7"):
        run(scalar_arithmetic, np.array([[5]], np.int32))
    monkeypatch.setenv("NKI_SIMULATOR_API", "0.8")
    with pytest.raises(SimulationError, match="NKI_SIMULATOR_API='0.8'"):
        run(scalar_arithmetic, np.array([[5]], np.int32))


def add_one(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_lnc_degree_must_match_the_compiler(monkeypatch):
    """NCC_EVRF066: an undeclared kernel is LNC 1; neuronx-cc at --lnc=2 rejects it under 0.7, 0.6 did not check."""
    import nki

    x = np.zeros((4, 8), np.float32)
    monkeypatch.delenv("NKI_SIMULATOR_API", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=2 -O1")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    kernel = nki.jit(add_one)
    with pytest.raises(SimulationError, match="NCC_EVRF066.*LNC=1, but neuronx-cc is using LNC=2"):
        kernel(x)
    np.testing.assert_array_equal(kernel[2](x), x + 1)           # declared with the grid
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    np.testing.assert_array_equal(kernel(x), x + 1)              # declared with the environment
    monkeypatch.setenv("NEURON_CC_FLAGS", "--logical-nc-config 1")
    with pytest.raises(SimulationError, match="NCC_EVRF066"):
        kernel[2](x)
    monkeypatch.setenv("NKI_SIMULATOR_API", "0.6")
    np.testing.assert_array_equal(kernel[2](x), x + 1)           # unchecked before 0.7


def test_0_7_table_names_its_source_and_changes():
    t = real_api.changes_07()
    assert "2.33" in t["source"] and "Migrating from NKI 0.6.0 to NKI 0.7.0" in t["source"]
    assert "dynamic_range" in real_api.names("nki.language", "0.6")
    assert "dynamic_range" not in real_api.names("nki.language", "0.7")
    assert "scalar_load" in real_api.names("nki.isa", "0.7") and "scalar_load" not in real_api.names("nki.isa", "0.6")
    assert real_api.params("nki.isa", "scalar_store", "0.7") == ["dst", "value"]


@pytest.mark.parametrize("source,version,fragment", [
    ("import nki.language as nl\nfor i in nl.dynamic_range(4):\n    pass\n", "0.7",
     "nki.language.dynamic_range is not in the NKI 0.7 API"),
    ("import nki.isa as nisa\nr = nisa.register_alloc(3)\nwhile r:\n    pass\n", "0.7",
     "while on the VirtualRegister 'r' was removed"),
    ("import nki.isa as nisa\nx = nisa.scalar_load(t)\n", "0.6", "nki.isa.scalar_load is not in the NKI 0.6 API"),
])
def test_checker_reports_constructs_outside_one_api(source, version, fragment):
    problems = real_api.check_source(source, "k.py", version=version)
    assert len(problems) == 1 and fragment in problems[0], problems
    assert real_api.check_source(source, "k.py") == []           # a name of one API passes the union check
