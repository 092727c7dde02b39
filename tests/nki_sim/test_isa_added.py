"""Documented APIs added to the simulator, each tested on the semantics the NKI 0.6 API reference states:
tensor_tensor_scan, nc_n_gather, local_gather, nonzero_with_count, registers (+ dynamic_range / while_loop / fori_loop bounds),
nl.broadcast_to, nl.rand / nl.random_seed, LNC2 sendrecv / core_barrier, nki.isa.constants and nki.dtype."""
from __future__ import annotations

import importlib

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in


@pytest.mark.parametrize("initial_tile", [False, True])
def test_tensor_tensor_scan_is_the_documented_recurrence(rng, initial_tile):
    d0, d1 = rng.standard_normal((2, 8, 12)).astype(np.float32)
    init = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(a_hbm, b_hbm, i_hbm):
        a, b = sbuf_in(a_hbm), sbuf_in(b_hbm)
        initial = sbuf_in(i_hbm) if initial_tile else 0.5
        out = nl.ndarray((8, 12), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=out, data0=a, data1=b, initial=initial, op0=nl.multiply, op1=nl.add)
        return hbm_out(out)

    got = run(kernel, d0, d1, init)
    prev = init[:, 0] if initial_tile else np.full(8, 0.5, np.float32)
    ref = np.empty_like(d0)
    for i in range(12):   # result[:, i] = op1(op0(data0[:, i], result[:, i-1]), data1[:, i])
        prev = d0[:, i] * prev + d1[:, i]
        ref[:, i] = prev
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_tensor_tensor_scan_reverse_flags_and_psum_rule(rng):
    d0, d1 = rng.standard_normal((2, 4, 5)).astype(np.float32)

    def kernel(a_hbm, b_hbm):
        a, b = sbuf_in(a_hbm), sbuf_in(b_hbm)
        out = nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=out, data0=a, data1=b, initial=1.0, op0=nl.subtract, op1=nl.subtract,
                                reverse0=True, reverse1=True)
        return hbm_out(out)

    prev, ref = np.ones(4, np.float32), np.empty_like(d0)
    for i in range(5):   # reverse0: prev - data0; reverse1: data1 - (...)
        prev = d1[:, i] - (prev - d0[:, i])
        ref[:, i] = prev
    np.testing.assert_allclose(run(kernel, d0, d1), ref, rtol=1e-6, atol=1e-6)

    def both_psum():
        p = nl.ndarray((4, 5), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor_scan(dst=nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf), data0=p, data1=p,
                                initial=0.0, op0=nl.add, op1=nl.add)

    with pytest.raises(SimulationError, match="cannot both be in PSUM"):
        run(both_psum)


def test_nc_n_gather_indexes_the_flattened_free_dims_per_partition(rng):
    data = rng.standard_normal((6, 3, 4)).astype(np.float32)
    idx = rng.integers(0, 12, size=(6, 5)).astype(np.uint32)

    def kernel(d_hbm, i_hbm):
        d, i = sbuf_in(d_hbm), sbuf_in(i_hbm)
        out = nl.ndarray((6, 5), nl.float32, buffer=nl.sbuf)
        nisa.nc_n_gather(dst=out, data=d, indices=i)
        return hbm_out(out)

    np.testing.assert_array_equal(run(kernel, data, idx), np.take_along_axis(data.reshape(6, 12), idx.astype(int), 1))
    with pytest.raises(SimulationError, match="out of range"):
        run(kernel, data, np.full((6, 5), 12, np.uint32))


def test_local_gather_follows_the_reference_numpy_semantics(rng):
    """The reference's example: src [128, 512, 4], one [16, 4] uint16 index block per GpSimd core (tiled 8 times),
    element offsets index * num_elem_per_idx, 64 valid indices, 4 contiguous elements each."""
    src = (rng.random((128, 512, 4)) * 100).astype(np.float32)
    per_core = rng.integers(0, 512, size=(16, 4)).astype(np.uint16)
    index = np.tile(per_core, (8, 1))

    def kernel(s_hbm, i_hbm):
        s_sb, i_sb = sbuf_in(s_hbm), sbuf_in(i_hbm)
        out = nl.ndarray((128, 64, 4), nl.float32, buffer=nl.sbuf)
        nisa.local_gather(dst=out, src_buffer=s_sb, index=i_sb, num_elem_per_idx=4, num_valid_indices=64)
        return hbm_out(out)

    want = np.empty((128, 64, 4), np.float32)
    for core in range(8):
        rows = slice(16 * core, 16 * core + 16)
        want[rows] = np.take(src[rows], index[rows].flatten(order="F")[:64], axis=1)
    np.testing.assert_array_equal(run(kernel, src, (index * 4).astype(np.uint16)), want)
    with pytest.raises(SimulationError, match="uint16"):
        run(kernel, src, (index * 4).astype(np.uint32))


def test_nonzero_with_count_documented_example_on_partitions_0_16_32():
    src = np.zeros((48, 8), np.float32)
    src[0] = [0, 1, 1, 0, 0, 1, 0, 0]
    src[16, 7] = 2.0
    src[1] = 1.0   # not a GpSimd core's first partition: ignored

    def kernel(s_hbm):
        s = sbuf_in(s_hbm)
        out = nl.full((48, 9), 7, nl.int32, buffer=nl.sbuf)
        nisa.nonzero_with_count(dst=out, src=s, index_offset=16, padding_val=-1)
        return hbm_out(out)

    out = run(kernel, src, target="trn2")
    np.testing.assert_array_equal(out[0], [17, 18, 21, -1, -1, -1, -1, -1, 3])
    np.testing.assert_array_equal(out[16], [23, -1, -1, -1, -1, -1, -1, -1, 1])
    np.testing.assert_array_equal(out[32], [-1] * 8 + [0])
    assert (out[1] == 7).all()   # other partitions untouched


def test_registers_drive_loops_and_offsets():
    def kernel(count_hbm):
        count_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=count_sb, src=count_hbm)
        reg = nisa.register_alloc()
        nisa.register_load(reg, count_sb)
        acc = nl.zeros((1, 1), nl.float32, buffer=nl.sbuf)
        one = nl.ones((1, 1), nl.float32, buffer=nl.sbuf)
        for _ in nl.dynamic_range(reg):                  # reg iterations
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
        nl.fori_loop(0, reg, lambda i: nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add))
        left = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=left, src=count_sb)
        ione = nl.ones((1, 1), nl.int32, buffer=nl.sbuf)

        def body(r):                                    # while r != 0: r = body(r)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
            nisa.tensor_tensor(dst=left, data1=left, data2=ione, op=nl.subtract)
            nxt = nisa.register_alloc()
            nisa.register_load(nxt, left)
            return nxt

        nl.while_loop(reg, body)
        moved = nisa.register_alloc(2)
        nisa.register_move(reg, moved)
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        nisa.register_store(out, reg)
        return hbm_out(acc), out

    acc, reg_out = run(kernel, np.array([[3]], np.int32))
    assert acc[0, 0] == 9 and reg_out[0, 0] == 2

    def unset():
        nisa.register_store(nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf), nisa.register_alloc())

    with pytest.raises(SimulationError, match="before it was written"):
        run(unset)


def test_broadcast_to_follows_numpy_rules(rng):
    x = rng.standard_normal((1, 6)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        return hbm_out(nl.broadcast_to(t, (16, 6))), hbm_out(nl.broadcast_to(t, (1, 6), dtype=nl.bfloat16))

    wide, cast = run(kernel, x)
    np.testing.assert_array_equal(wide, np.broadcast_to(x, (16, 6)))
    np.testing.assert_array_equal(cast.astype(np.float32), x.astype(cast.dtype).astype(np.float32))
    with pytest.raises(SimulationError, match="cannot broadcast"):
        run(lambda x_hbm: nl.broadcast_to(sbuf_in(x_hbm), (16, 3)) and None, x)


def test_rand_is_uniform_and_random_seed_repeats_the_sequence():
    def kernel():
        seed = nl.full((1, 1), 42, nl.int32, buffer=nl.sbuf)
        nl.random_seed(seed)
        a = nl.rand((128, 64), nl.float32)
        nl.random_seed(seed)
        b = nl.rand((128, 64), nl.float32)
        c = nl.rand((128, 64), nl.float32)
        return hbm_out(a), hbm_out(b), hbm_out(c)

    a, b, c = run(kernel)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(b, c) and a.min() >= 0.0 and a.max() < 1.0 and 0.45 < a.mean() < 0.55


def _exchange_kernel(x_hbm):
    """Each core sends its half of x to the other core; out[core] = the half it received (documented ring)."""
    n = x_hbm.shape[0] // 2
    me = nl.program_id(0)
    out = nl.ndarray(x_hbm.shape, x_hbm.dtype, buffer=nl.shared_hbm)
    mine = nl.ndarray((n, x_hbm.shape[1]), x_hbm.dtype, buffer=nl.sbuf)
    got = nl.ndarray((n, x_hbm.shape[1]), x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x_hbm[me * n:(me + 1) * n, :])
    nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
    nisa.dma_copy(dst=out[me * n:(me + 1) * n, :], src=got)
    nisa.core_barrier(data=out, cores=(0, 1))
    # after the barrier both halves are written: each core reads the other core's half back
    back = nl.ndarray((n, x_hbm.shape[1]), x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=back, src=out[(1 - me) * n:(2 - me) * n, :])
    check = nl.ndarray(x_hbm.shape, x_hbm.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=check[me * n:(me + 1) * n, :], src=back)
    return out, check


def test_lnc2_sendrecv_and_core_barrier_run_both_programs_concurrently(rng):
    x = rng.standard_normal((8, 4)).astype(np.float32)
    out, check = run(_exchange_kernel, x, lnc=2, target="trn2")
    swapped = np.concatenate([x[4:], x[:4]])
    np.testing.assert_array_equal(out, swapped)
    np.testing.assert_array_equal(check, x)   # each core saw the other's write only after the barrier


def test_sendrecv_needs_lnc2_and_a_matching_peer(rng):
    x = rng.standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(SimulationError, match="LNC2 launch"):
        run(_exchange_kernel, x, lnc=1, target="trn2")

    def lonely(x_hbm):
        if nl.program_id(0) == 0:
            t = sbuf_in(x_hbm)
            nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=3)

    with pytest.raises(SimulationError, match="returned without the matching call"):
        run(lonely, x, lnc=2, target="trn2")


def test_constants_and_dtype_modules_import_like_nki_library():
    constants = importlib.import_module("nki.isa.constants")
    dtype = importlib.import_module("nki.dtype")
    assert constants.oob_mode is nisa.oob_mode and constants.dge_mode is nisa.dge_mode
    assert dtype.bfloat16 == nl.bfloat16 and dtype.float8_e4m3fn == nl.float8_e4m3fn
