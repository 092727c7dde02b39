"""Further documented instructions (NKI documentation) against NumPy references."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in


def test_tensor_copy_predicated_tile_and_scalar(rng):
    x, d = rng.standard_normal((2, 8, 10)).astype(np.float32)
    pred = rng.integers(0, 2, size=(8, 10)).astype(np.uint8)

    def kernel(x_hbm, d_hbm, p_hbm):
        src, dst, p = sbuf_in(x_hbm), sbuf_in(d_hbm), sbuf_in(p_hbm)
        nisa.tensor_copy_predicated(dst=dst, src=src, predicate=p)
        other = sbuf_in(d_hbm)
        nisa.tensor_copy_predicated(dst=other, src=-1.0, predicate=p, reverse_pred=True)
        return hbm_out(dst), hbm_out(other)

    a, b = run(kernel, x, d, pred)
    np.testing.assert_array_equal(a, np.where(pred != 0, x, d))
    np.testing.assert_array_equal(b, np.where(pred == 0, -1.0, d))


def test_dma_compute_sums_sources_including_dst(rng):
    a, b = rng.standard_normal((2, 16, 8)).astype(np.float32)

    def kernel(a_hbm, b_hbm):
        out = nl.ndarray((16, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a_hbm)
        nisa.dma_compute(dst=out, srcs=(out, b_hbm, a_hbm), reduce_op=nl.add)
        return out

    np.testing.assert_allclose(run(kernel, a, b), 2 * a + b, rtol=1e-6)
    with pytest.raises(SimulationError, match="reduce_op must be nl.add"):
        run(lambda a_hbm: nisa.dma_compute(dst=a_hbm, srcs=(a_hbm,), reduce_op=nl.maximum), a)


def test_max8_find_index8_and_match_replace8(rng):
    data = rng.permutation(64).reshape(4, 16).astype(np.float32)
    data[:, 15] = data[:, 3]   # a duplicate of the value at column 3

    def kernel(d_hbm):
        d = sbuf_in(d_hbm)
        top = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=top, src=d)
        vals = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=vals, src=d[:, 0:8])
        nisa.tensor_copy(dst=vals[:, 7:8], src=d[:, 3:4])       # value at col 3 twice -> cols 3 and 15
        idx = nl.ndarray((4, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=d, vals=vals)
        rep = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
        ridx = nl.ndarray((4, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=rep, data=d, vals=top, imm=-1.0, dst_idx=ridx)
        return hbm_out(top), hbm_out(idx), hbm_out(rep), hbm_out(ridx)

    top, idx, rep, ridx = run(kernel, data)
    ref_top = -np.sort(-data, axis=1)[:, :8]
    np.testing.assert_array_equal(top, ref_top)
    np.testing.assert_array_equal(idx[:, :7], np.tile(np.arange(7), (4, 1)))
    np.testing.assert_array_equal(idx[:, 7], 15)               # second occurrence of the duplicated value
    ref_rep = data.copy()
    for p in range(4):
        for v in ref_top[p]:
            ref_rep[p, np.nonzero(ref_rep[p] == v)[0][0]] = -1.0
    np.testing.assert_array_equal(rep, ref_rep)
    np.testing.assert_array_equal(np.take_along_axis(data, ridx.astype(np.int64), axis=1), ref_top)


def test_find_index8_unmatched_is_all_ones():
    def kernel():
        d = nl.zeros((2, 10), nl.float32)
        v = nl.full((2, 8), 3.0, nl.float32)
        idx = nl.ndarray((2, 8), nl.uint16, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=d, vals=v)
        return hbm_out(idx)

    np.testing.assert_array_equal(run(kernel), 0xFFFF)


def test_bn_stats_then_bn_aggr_give_mean_and_variance(rng):
    x = rng.standard_normal((8, 1000)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        stats = nl.ndarray((8, 2, 6), nl.float32, buffer=nl.sbuf)
        for c in range(2):
            nisa.bn_stats(dst=stats[:, c, :], data=t[:, c * 500:(c + 1) * 500])
        mv = nl.ndarray((8, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=stats)
        return hbm_out(mv)

    mv = run(kernel, x)
    np.testing.assert_allclose(mv[:, 0], x.astype(np.float64).mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv[:, 1], x.astype(np.float64).var(axis=1), rtol=1e-5)
    with pytest.raises(SimulationError, match="exceeds bn_stats_fmax 512"):
        run(lambda: nisa.bn_stats(dst=nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf),
                                  data=nl.ndarray((4, 513), nl.float32, buffer=nl.sbuf)))


def test_nc_stream_shuffle_per_quadrant_with_keep(rng):
    x = rng.standard_normal((64, 4)).astype(np.float32)
    mask = [(i + 1) % 32 for i in range(32)]
    mask[5] = 255

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        d = nl.zeros((64, 4), nl.float32)
        nisa.nc_stream_shuffle(dst=d, src=t, shuffle_mask=mask)
        return hbm_out(d)

    out = run(kernel, x)
    ref = np.zeros_like(x)
    for q in (0, 32):
        for i, m in enumerate(mask):
            if m != 255:
                ref[q + i] = x[q + m]
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(SimulationError, match="start must be one of"):
        run(lambda: nisa.nc_stream_shuffle(dst=nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf)[16:48],
                                           src=nl.ndarray((32, 4), nl.float32, buffer=nl.sbuf), shuffle_mask=mask))


def test_tensor_partition_reduce(rng):
    x = rng.standard_normal((40, 6)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        s = nl.ndarray((1, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=s, op=nl.maximum, data=t)
        return hbm_out(s)

    np.testing.assert_array_equal(run(kernel, x), x.max(axis=0, keepdims=True))
