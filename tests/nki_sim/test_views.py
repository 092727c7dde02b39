"""Storage + view model: indexing rules on-chip vs HBM, nl.ds, .ap (incl. stride-0), .view, reshape, fill values."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in


def test_on_chip_integer_indexing_keeps_partition_and_two_dims():
    shapes = {}

    def kernel():
        t = nl.ndarray((64, 64, 64), nl.float32, buffer=nl.sbuf)
        shapes.update(a=t[0, 0, 10].shape, b=t[:, 0].shape, c=t[:, 0, 10].shape, d=t[3].shape, e=t[..., 5].shape)

    run(kernel)
    assert shapes == {"a": (1, 1), "b": (64, 64), "c": (64, 1), "d": (1, 64, 64), "e": (64, 64)}


def test_hbm_integer_indexing_drops_dims_like_numpy():
    shapes = {}

    def kernel(x):
        shapes.update(a=x[0].shape, b=x[1, 2].shape, c=x[:, 0].shape, d=x[nl.ds(1, 3), :, 1:5:2].shape)

    run(kernel, np.zeros((4, 5, 6), np.float32))
    assert shapes == {"a": (5, 6), "b": (6,), "c": (4, 6), "d": (3, 5, 2)}


def test_strided_and_ds_slices_read_the_right_elements(rng):
    x = rng.standard_normal((6, 20)).astype(np.float32)

    def kernel(x_hbm):
        t = nl.ndarray((3, 5), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_hbm[nl.ds(1, 3), 2:20:4])
        u = nl.ndarray((3, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t[:, -5:])
        return hbm_out(u)

    np.testing.assert_array_equal(run(kernel, x), x[1:4, 2:20:4])


def test_negative_indices_and_strided_write(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x_hbm)
        nisa.dma_copy(dst=out[:, 1::2], src=t[:, 0:8:2])   # scatter even columns into odd ones
        nisa.dma_copy(dst=out[-1], src=x_hbm[0])
        return out

    ref = x.copy()
    ref[:, 1::2] = x[:, 0::2]
    ref[-1] = x[0]
    np.testing.assert_array_equal(run(kernel, x), ref)


def test_ap_stride_zero_broadcast_on_hbm_read(rng):
    g = rng.standard_normal(16).astype(np.float32)

    def kernel(g_hbm):
        t = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=g_hbm.ap(pattern=[[0, 8], [1, 16]], offset=0))
        return hbm_out(t)

    np.testing.assert_array_equal(run(kernel, g), np.broadcast_to(g, (8, 16)))


def test_ap_on_sbuf_addresses_storage_and_checks_partition_stride(rng):
    x = rng.standard_normal((4, 12)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        col = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        # partition stride = 12 (allocation free size); every second element starting at 1; ignores the view
        nisa.tensor_copy(dst=col, src=t[0:2, 0:3].ap(pattern=[[12, 4], [2, 6]], offset=1))
        bcast = nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=bcast, src=t.ap(pattern=[[12, 4], [0, 5]], offset=3))   # broadcast column 3
        return hbm_out(col), hbm_out(bcast)

    col, bcast = run(kernel, x)
    np.testing.assert_array_equal(col, x[:, 1::2])
    np.testing.assert_array_equal(bcast, np.repeat(x[:, 3:4], 5, axis=1))


def test_ap_wrong_partition_stride_raises():
    def kernel():
        t = nl.ndarray((4, 12), nl.float32, buffer=nl.sbuf)
        t.ap(pattern=[[6, 4], [1, 6]])

    with pytest.raises(SimulationError, match="partition dim and its stride must be 12"):
        run(kernel)


def test_stride_zero_destination_keeps_the_last_element_written(rng):
    """A broadcast (stride-0) dst is legal: the elements that share an address are written in order."""
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x_hbm):
        src = sbuf_in(x_hbm)
        t = nl.zeros((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t.broadcast(1, 8), src=src)
        return hbm_out(t)

    np.testing.assert_array_equal(run(kernel, x), x[:, 7:8])


def test_view_reinterprets_bits_and_rescales_last_dim(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        bits = nl.ndarray((4, 6), nl.uint32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=bits, src=t.view(nl.uint32))
        halves = t.view(nl.bfloat16)
        h = nl.ndarray(halves.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=h, src=halves)
        return hbm_out(bits), hbm_out(h)

    bits, halves = run(kernel, x)
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    assert halves.shape == (4, 12)
    np.testing.assert_array_equal(halves.view(np.uint16), x.view(np.uint16))


def test_reshape_permute_broadcast_views(rng):
    x = rng.standard_normal((4, 2, 3)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        flat = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=flat, src=t.reshape((4, 6)))
        perm = nl.ndarray((4, 3, 2), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=perm, src=t.permute((0, 2, 1)))
        b = nl.ndarray((4, 2, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=t[:, :, 1:2].broadcast(2, 5))
        return hbm_out(flat), hbm_out(perm), hbm_out(b)

    flat, perm, b = run(kernel, x)
    np.testing.assert_array_equal(flat, x.reshape(4, 6))
    np.testing.assert_array_equal(perm, x.transpose(0, 2, 1))
    np.testing.assert_array_equal(b, np.repeat(x[:, :, 1:2], 5, axis=2))


@pytest.mark.parametrize("index,match", [((slice(0, 9), slice(None)), "out of range"),
                                         ((4, 0), "index 4 out of range"),
                                         ((slice(None), slice(None, None, -1)), "step must be positive")])
def test_bad_indices_raise(index, match):
    def kernel():
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        t[index]

    with pytest.raises(SimulationError, match=match):
        run(kernel)


def test_fresh_tensors_are_nan_or_four():
    def kernel():
        f = nl.ndarray((4, 3), nl.bfloat16, buffer=nl.shared_hbm)
        i = nl.ndarray((4, 3), nl.int32, buffer=nl.shared_hbm)
        s = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        return f, i, hbm_out(s)

    f, i, s = run(kernel)
    assert np.isnan(f.astype(np.float32)).all() and np.isnan(s).all()
    np.testing.assert_array_equal(i, np.full((4, 3), 4, np.int32))


def test_buffer_must_be_an_object_and_on_chip_at_least_2d():
    with pytest.raises(SimulationError, match="not the string"):
        run(lambda: nl.ndarray((4, 4), nl.float32, buffer="sbuf"))
    with pytest.raises(SimulationError, match=">= 2 dims"):
        run(lambda: nl.ndarray((128,), nl.float32, buffer=nl.sbuf))


def test_partition_step_access_raises():
    def kernel():
        t = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t[0:8:2, :], value=0.0)

    with pytest.raises(SimulationError, match="contiguous range of partitions"):
        run(kernel)
