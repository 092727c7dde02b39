"""dma_copy, dma_transpose, tensor_copy, memset, iota: semantics and validation (NKI documentation)."""
from __future__ import annotations

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, run_events, sbuf_in

BF16 = ml_dtypes.bfloat16


def test_dma_copy_casts_through_fp32_and_reshapes_by_element_order(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def kernel(x_hbm):
        t = nl.ndarray((4, 2, 3), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_hbm)
        return hbm_out(t)

    out = run(kernel, x)
    np.testing.assert_array_equal(out.reshape(4, 6).view(np.uint16), x.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("case,match", [
    ("psum_src", "dma_copy src must be in HBM or SBUF"),
    ("count", "element counts differ"),
    ("hwdge", "dge_mode=hwdge needs equal dtypes"),
    ("partitions", "partition dimension 256 exceeds maximum 128"),
    ("enum", "must be a nisa.dge_mode member"),
])
def test_dma_copy_validation(case, match):
    def kernel(x_hbm):
        if case == "psum_src":
            p = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
            nisa.dma_copy(dst=x_hbm, src=p)
        elif case == "count":
            nisa.dma_copy(dst=nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf), src=x_hbm)
        elif case == "hwdge":
            nisa.dma_copy(dst=nl.ndarray((4, 4), nl.bfloat16, buffer=nl.sbuf), src=x_hbm,
                          dge_mode=nisa.dge_mode.hwdge)
        elif case == "partitions":
            nisa.dma_copy(dst=nl.ndarray((256, 1), nl.float32, buffer=nl.sbuf), src=x_hbm.ap([[1, 16], [0, 16]]))
        else:
            nisa.dma_copy(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), src=x_hbm, dge_mode="swdge")

    with pytest.raises(SimulationError, match=match):
        run(kernel, np.zeros((4, 4), np.float32))


def test_dma_copy_event_counts_bytes_and_buffers():
    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        return hbm_out(t)

    _, events = run_events(kernel, np.zeros((128, 64), BF16))
    first = events[0]
    assert (first.engine, first.op, first.partitions, first.free_elems) == ("dma", "dma_copy", 128, 64)
    assert (first.dma_bytes, first.src_buffer, first.dst_buffer, first.in_dtype) == (128 * 64 * 2, "hbm", "sbuf", "bfloat16")
    assert [e.dst_buffer for e in events] == ["sbuf", "hbm"]


def test_dma_transpose_2d_and_generation_gate(rng):
    x = rng.standard_normal((16, 40)).astype(BF16)

    def kernel(x_hbm):
        t = nl.ndarray((40, 16), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x_hbm)
        return hbm_out(t)

    np.testing.assert_array_equal(run(kernel, x).view(np.uint16), x.T.view(np.uint16))
    with pytest.raises(SimulationError, match="requires NeuronCore gen3"):
        run(kernel, x, target="trn1")
    with pytest.raises(SimulationError, match="needs equal dtypes"):
        run(kernel, x.astype(np.float32))


def test_tensor_copy_psum_to_sbuf_with_cast_and_partial_tile(rng):
    x = rng.standard_normal((100, 30)).astype(np.float32)

    def kernel(x_hbm):
        p = sbuf_in(x_hbm, buffer=nl.psum)
        s = nl.ndarray((100, 30), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=p)
        return hbm_out(s)

    np.testing.assert_array_equal(run(kernel, x).view(np.uint16), x.astype(BF16).view(np.uint16))


def test_tensor_copy_rules():
    def gpsimd_psum():
        p = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), src=p, engine=nisa.engine.gpsimd)

    def scalar_gen2():
        s = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), src=s, engine=nisa.scalar_engine)

    def mismatch():
        s = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf), src=s)

    with pytest.raises(SimulationError, match="src must be in SBUF, but .* is in PSUM"):
        run(gpsimd_psum)
    with pytest.raises(SimulationError, match="on the scalar engine .* requires NeuronCore gen3"):
        run(scalar_gen2, target="trn1")
    with pytest.raises(SimulationError, match="partition dimensions differ"):
        run(mismatch)


def test_memset_values_and_type_rules():
    def kernel():
        f = nl.ndarray((4, 3), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=f, value=1.5)
        i = nl.ndarray((4, 3), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=i, value=-7)
        return hbm_out(f), hbm_out(i)

    f, i = run(kernel)
    assert (f.astype(np.float32) == 1.5).all() and (i == -7).all()

    def bad_int():
        nisa.memset(dst=nl.ndarray((4, 3), nl.int32, buffer=nl.sbuf), value=0.5)

    def bad_x4():
        nisa.memset(dst=nl.ndarray((32, 3), nl.float8_e4m3fn_x4, buffer=nl.sbuf), value=1)

    with pytest.raises(SimulationError, match="integer type; pass an int"):
        run(bad_int)
    with pytest.raises(SimulationError, match="supports only value 0"):
        run(bad_x4)


def test_iota_pattern_offset_and_channel_multiplier():
    def kernel():
        t = nl.ndarray((8, 2, 5), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=t, pattern=[[10, 2], [1, 5]], offset=3, channel_multiplier=100)
        f = nl.ndarray((8, 10), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=f, pattern=[[-1, 10]], offset=0, channel_multiplier=1)
        return hbm_out(t), hbm_out(f)

    t, f = run(kernel)
    p, a, b = np.indices((8, 2, 5))
    np.testing.assert_array_equal(t, 3 + 100 * p + 10 * a + b)
    p2, j = np.indices((8, 10))
    np.testing.assert_array_equal(f, (p2 - j).astype(np.float32))


def test_iota_rules():
    def psum_dst():
        nisa.iota(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.psum), pattern=[[1, 4]])

    def bad_count():
        nisa.iota(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), pattern=[[1, 5]])

    with pytest.raises(SimulationError, match="iota dst must be in SBUF"):
        run(psum_dst)
    with pytest.raises(SimulationError, match="covers 5 elements per partition but dst has 4"):
        run(bad_count)


def test_dma_between_words_and_packed_mx_needs_a_view():
    def kernel(w_hbm):
        q = nl.ndarray((32, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=q, src=w_hbm)

    with pytest.raises(SimulationError, match="reinterpret one side with .view"):
        run(kernel, np.zeros((32, 4), np.uint32))
