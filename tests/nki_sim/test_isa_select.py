"""affine_select, range_select, select_reduce (NKI documentation)."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in

FP32_MIN = np.finfo(np.float32).min


def test_affine_select_causal_pattern_with_offset(rng):
    s = rng.standard_normal((64, 96)).astype(np.float32)

    def kernel(s_hbm):
        t = sbuf_in(s_hbm)
        o = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=o, pattern=[[-1, 96]], channel_multiplier=1, on_true_tile=t,
                           on_false_value=-1e9, cmp_op=nl.greater_equal, offset=10)
        e = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=e, pattern=[[1, 96]], channel_multiplier=-2, on_true_tile=t, on_false_value=0.0)
        return hbm_out(o), hbm_out(e)

    o, e = run(kernel, s)
    p, j = np.indices(s.shape)
    np.testing.assert_array_equal(o, np.where(10 + p - j >= 0, s, np.float32(-1e9)))
    np.testing.assert_array_equal(e, np.where(j - 2 * p == 0, s, 0))   # default cmp_op = nl.equal


def test_affine_select_rules():
    def psum_in():
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.affine_select(dst=nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf), pattern=[[1, 8]],
                           channel_multiplier=0, on_true_tile=t, on_false_value=0.0)

    def not_compare():
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=t, pattern=[[1, 8]], channel_multiplier=0, on_true_tile=t, on_false_value=0.0,
                           cmp_op=nl.add)

    with pytest.raises(SimulationError, match="on_true_tile must be in SBUF"):
        run(psum_in)
    with pytest.raises(SimulationError, match="cmp_op must be a comparison"):
        run(not_compare)


def test_range_select_bounds_and_max_reduce(rng):
    x = rng.standard_normal((16, 40)).astype(np.float32)
    lo = rng.integers(90, 110, size=(16, 1)).astype(np.float32)
    hi = lo + rng.integers(0, 20, size=(16, 1)).astype(np.float32)

    def kernel(x_hbm, lo_hbm, hi_hbm):
        t, b0, b1 = sbuf_in(x_hbm), sbuf_in(lo_hbm), sbuf_in(hi_hbm)
        o = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=o, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0, bound1=b1,
                          reduce_res=m, range_start=100)
        return hbm_out(o), hbm_out(m)

    o, m = run(kernel, x, lo, hi)
    j = 100 + np.arange(40)[None, :]
    keep = (j >= lo) & (j < hi)
    ref = np.where(keep, x, FP32_MIN)
    np.testing.assert_array_equal(o, ref)
    np.testing.assert_array_equal(m[:, 0], ref.max(axis=1))


def test_range_select_rules():
    def kernel(value):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=t, on_true_tile=t, comp_op0=nl.less, comp_op1=nl.less, bound0=b, bound1=b,
                          on_false_value=value)

    with pytest.raises(SimulationError, match="on_false_value must be FP32_MIN"):
        run(lambda: kernel(-1e30))
    with pytest.raises(SimulationError, match="range_select requires NeuronCore gen3"):
        run(lambda: kernel(FP32_MIN), target="trn1")


def test_select_reduce_predicate_reverse_and_accumulator(rng):
    x = rng.standard_normal((8, 12)).astype(np.float32)
    pred = rng.integers(0, 2, size=(8, 12)).astype(np.uint8)
    fill = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(x_hbm, p_hbm, f_hbm):
        t, p, f = sbuf_in(x_hbm), sbuf_in(p_hbm), sbuf_in(f_hbm)
        o = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=o, predicate=p, on_true=t, on_false=f, reduce_res=m,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce, reverse_pred=True)
        return hbm_out(o), hbm_out(m)

    o, m = run(kernel, x, pred, fill)
    ref = np.where(pred == 0, x, fill)
    np.testing.assert_array_equal(o, ref)
    np.testing.assert_array_equal(m[:, 0], ref.max(axis=1))
