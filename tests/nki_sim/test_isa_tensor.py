"""Tensor engine: nc_matmul (accumulate, limits, dtype pairing, double_row, transpose) and nc_transpose (§5.1, A.3)."""
from __future__ import annotations

import warnings

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError, SimulatorWarning

from .conftest import hbm_out, run, run_events, sbuf_in

BF16, E4M3 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3


def _mm_kernel(accumulates, psum_dtype=nl.float32, **kw):
    def kernel(s_hbm, m_hbm):
        s, m = sbuf_in(s_hbm), sbuf_in(m_hbm)
        acc = nl.ndarray((s.shape[-1], m.shape[-1]), psum_dtype, buffer=nl.psum)
        for flag in accumulates:
            nisa.nc_matmul(dst=acc, stationary=s, moving=m, accumulate=flag, **kw)
        return hbm_out(acc)
    return kernel


def test_matmul_bf16_inputs_fp32_accumulation(rng):
    s = rng.standard_normal((96, 40)).astype(BF16)
    m = rng.standard_normal((96, 300)).astype(BF16)
    out, events = run_events(_mm_kernel([False]), s, m)
    np.testing.assert_allclose(out, s.astype(np.float64).T @ m.astype(np.float64), rtol=1e-5, atol=1e-5)
    mm = next(e for e in events if e.op == "nc_matmul")
    assert (mm.engine, mm.matmul_kmn, mm.free_elems, mm.in_dtype) == ("tensor", (96, 40, 300), 300, "bfloat16")


@pytest.mark.parametrize("flags,factor", [([False, True, True], 3), ([None, None], 2), ([True, False], 1)])
def test_matmul_accumulate_flags(rng, flags, factor):
    s = rng.standard_normal((32, 16)).astype(np.float32)
    m = rng.standard_normal((32, 24)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SimulatorWarning)
        out = run(_mm_kernel(flags), s, m)
    np.testing.assert_allclose(out, factor * (s.astype(np.float64).T @ m), rtol=1e-5, atol=1e-5)


def test_accumulate_true_into_unwritten_psum_warns():
    s = np.ones((4, 4), np.float32)
    with pytest.warns(SimulatorWarning, match="never written by a matmul"):
        run(_mm_kernel([True]), s, s)


def test_accumulate_none_is_per_element_for_overlapping_writes(rng):
    s = rng.standard_normal((8, 4)).astype(np.float32)
    m = rng.standard_normal((8, 6)).astype(np.float32)

    def kernel(s_hbm, m_hbm):
        st, mv = sbuf_in(s_hbm), sbuf_in(m_hbm)
        acc = nl.ndarray((4, 9), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc[:, 0:6], stationary=st, moving=mv)
        nisa.nc_matmul(dst=acc[:, 3:9], stationary=st, moving=mv)   # columns 3..5 accumulate, 6..8 overwrite
        return hbm_out(acc)

    r = s.astype(np.float64).T @ m
    ref = np.zeros((4, 9))
    ref[:, 0:6] += r
    ref[:, 3:9] += r
    np.testing.assert_allclose(run(kernel, s, m), ref, rtol=1e-5, atol=1e-6)


def test_non_matmul_write_resets_the_accumulate_state(rng):
    s = rng.standard_normal((8, 4)).astype(np.float32)

    def kernel(s_hbm):
        st = sbuf_in(s_hbm)
        acc = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=st, moving=st)
        nisa.memset(dst=acc, value=0.0)
        nisa.nc_matmul(dst=acc, stationary=st, moving=st)   # None: the memset cleared the bits -> overwrite
        return hbm_out(acc)

    np.testing.assert_allclose(run(kernel, s), s.astype(np.float64).T @ s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes,target,match", [
    (((129, 4), (129, 4)), "trn3", "stationary partition dimension 129 exceeds maximum 128"),
    (((64, 130), (64, 4)), "trn3", "stationary free M=130 exceed"),
    (((64, 16), (64, 513)), "trn2", "moving free size N=513 exceeds 512 on gen3"),
    (((64, 16), (64, 4097)), "trn3", "N=4097 exceeds 4096 on gen4"),
    (((64, 16), (32, 8)), "trn3", "partition dimensions differ"),
])
def test_matmul_shape_limits(shapes, target, match):
    def kernel():
        s = nl.ndarray(shapes[0], nl.bfloat16, buffer=nl.sbuf)
        m = nl.ndarray(shapes[1], nl.bfloat16, buffer=nl.sbuf)
        acc = nl.ndarray((min(shapes[0][1], 128), min(shapes[1][1], 4096)), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=s, moving=m)

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target)


def test_matmul_n_up_to_4096_on_gen4(rng):
    s = rng.standard_normal((16, 8)).astype(BF16)
    m = rng.standard_normal((16, 1024)).astype(BF16)
    out = run(_mm_kernel([False]), s, m, target="trn3")
    np.testing.assert_allclose(out, s.astype(np.float64).T @ m.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtypes,psum,target,match", [
    ((nl.float32, nl.bfloat16), nl.float32, "trn3", "fp32/tf32 operands must be paired"),
    ((nl.float8_e4m3, nl.float8_e4m3fn), nl.float32, "trn3", "cannot mix float8_e4m3 and float8_e4m3fn"),
    ((nl.float8_e4m3fn, nl.float8_e4m3fn), nl.float32, "trn2", "float8_e4m3fn needs gen4"),
    ((nl.bfloat16, nl.bfloat16), nl.bfloat16, "trn2", "dst .PSUM. dtype must be float32 on gen3"),
    ((nl.int8, nl.int8), nl.float32, "trn3", "not a TensorE input type"),
])
def test_matmul_dtype_rules(dtypes, psum, target, match):
    def kernel():
        s = nl.ndarray((8, 4), dtypes[0], buffer=nl.sbuf)
        m = nl.ndarray((8, 4), dtypes[1], buffer=nl.sbuf)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), psum, buffer=nl.psum), stationary=s, moving=m)

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target)


def test_matmul_buffer_rules():
    def psum_input():
        s = nl.ndarray((8, 4), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.psum), stationary=s, moving=s)

    def sbuf_dst():
        s = nl.ndarray((8, 4), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), stationary=s, moving=s)

    with pytest.raises(SimulationError, match="stationary must be in SBUF"):
        run(psum_input)
    with pytest.raises(SimulationError, match="dst must be in PSUM"):
        run(sbuf_dst)


def test_matmul_output_must_fit_one_bank_on_gen3():
    def kernel():
        s = nl.ndarray((8, 4), nl.bfloat16, buffer=nl.sbuf)
        m = nl.ndarray((8, 256), nl.bfloat16, buffer=nl.sbuf)
        acc = nl.ndarray((4, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc[:, 384:640], stationary=s, moving=m)

    with pytest.raises(SimulationError, match="crosses a 2048 B bank boundary"):
        run(kernel, target="trn2")
    run(kernel, target="trn3")   # gen4 outputs may span banks


def test_matmul_bf16_psum_on_gen4_rounds_each_accumulation(rng):
    s = rng.standard_normal((16, 8)).astype(BF16)
    m = rng.standard_normal((16, 12)).astype(BF16)
    out = run(_mm_kernel([False, True], psum_dtype=nl.bfloat16), s, m)
    r = (s.astype(np.float32).T @ m.astype(np.float32))
    ref = (r.astype(BF16).astype(np.float32) + r).astype(BF16)   # upcast -> fp32 add -> round
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=2 ** -7)


def test_double_row_fp8_matmul(rng):
    s = rng.uniform(-4, 4, size=(128, 2, 16)).astype(E4M3)
    m = rng.uniform(-4, 4, size=(128, 2, 64)).astype(E4M3)
    out, events = run_events(_mm_kernel([False], perf_mode=nisa.matmul_perf_mode.double_row), s, m, target="trn2")
    ref = np.einsum("pjm,pjn->mn", s.astype(np.float64), m.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    mm = next(e for e in events if e.op == "nc_matmul")
    assert mm.perf_mode == "double_row" and mm.matmul_kmn == (256, 16, 64)


@pytest.mark.parametrize("dtype,target,match", [(nl.bfloat16, "trn2", "needs fp8 operands"),
                                                (nl.float8_e4m3, "trn1", "double_row needs gen3")])
def test_double_row_rules(dtype, target, match):
    def kernel():
        s = nl.ndarray((128, 2, 16), dtype, buffer=nl.sbuf)
        nisa.nc_matmul(dst=nl.ndarray((16, 16), nl.float32, buffer=nl.psum), stationary=s, moving=s,
                       perf_mode=nisa.matmul_perf_mode.double_row)

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target)


def test_transpose_mode_and_nc_transpose_are_bit_exact(rng):
    x = rng.standard_normal((64, 48)).astype(BF16)
    x[0, 0] = np.nan

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        ident = nl.shared_identity_matrix(64, dtype=nl.bfloat16)
        a = nl.ndarray((48, 64), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=a, stationary=t, moving=ident, is_transpose=True)
        b = nl.ndarray((48, 64), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=b, data=t)
        small = nl.ndarray((16, 16), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_transpose(dst=small, data=t[0:16, 0:16])      # SBUF -> SBUF: Vector engine (<= 32x32)
        return hbm_out(a), hbm_out(b), hbm_out(small)

    a, b, small = run(kernel, x)
    for got, ref in ((a, x.T), (b, x.T), (small, x[:16, :16].T)):
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_nc_transpose_rules():
    def vector_too_big():
        t = nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf), data=t)

    def dtype_change():
        t = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_transpose(dst=nl.ndarray((8, 8), nl.float32, buffer=nl.psum), data=t)

    with pytest.raises(SimulationError, match="vector engine supports at most \\[32, 32\\]"):
        run(vector_too_big)
    with pytest.raises(SimulationError, match="must equal data dtype"):
        run(dtype_change)


def test_pe_tiling_limits():
    def kernel(rows):
        s = nl.ndarray((64, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_matmul(dst=nl.ndarray((32, 32), nl.float32, buffer=nl.psum), stationary=s, moving=s[:, 0:32],
                       tile_position=(0, 0), tile_size=(rows, 32))

    run(lambda: kernel(64))
    with pytest.raises(SimulationError, match="exceed the PE array tile \\(32 rows"):
        run(lambda: kernel(32))
