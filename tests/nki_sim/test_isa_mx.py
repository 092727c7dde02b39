"""quantize_mx / nc_matmul_mx hardware semantics (NKI documentation) against neuron_infer.quant.mx_golden."""
from __future__ import annotations

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from neuron_infer.quant import mx_golden
from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in

BF16 = ml_dtypes.bfloat16


def _quant_kernel(dtype):
    def kernel(x_hbm):
        x = sbuf_in(x_hbm)
        p, f = x.shape
        q = nl.ndarray((p, f // 4), dtype, buffer=nl.sbuf)
        sc = nl.ndarray((p, f // 4), nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=sc, value=0)
        nisa.quantize_mx(dst=q, src=x, dst_scale=sc)
        return hbm_out(q), hbm_out(sc)
    return kernel


@pytest.mark.parametrize("p,fmt,dtype", [(128, "e4m3fn", nl.float8_e4m3fn_x4), (32, "e5m2", nl.float8_e5m2_x4),
                                         (64, "e4m3fn", nl.float8_e4m3fn_x4)])
def test_quantize_mx_matches_golden_bits(rng, p, fmt, dtype):
    f = 24
    x = (rng.standard_normal((p, f * 4)) * np.exp2(rng.integers(-20, 20, size=(1, f * 4)))).astype(BF16)
    x[:8, :4] = 0   # an all-zero block -> scale byte 0
    words, scales = run(_quant_kernel(dtype), x)
    # quad layout: x[p, f*4 + q] is logical contraction row k = q*P + p of column f
    w_kf = x.reshape(p, f, 4).transpose(2, 0, 1).reshape(4 * p, f)        # [P, F, 4] -> [4, P, F] -> [K, F]
    g_words, g_scales = mx_golden.quantize_for_matmul(w_kf, fmt, rule="nki", partitions=p)
    np.testing.assert_array_equal(words, g_words)
    placed = mx_golden.scatter_scales_sbuf(g_scales, partitions=p)   # [P/8, F] (P <= 32) or [P, F]
    np.testing.assert_array_equal(scales[: placed.shape[0]], placed)
    assert not scales[placed.shape[0]:].any()   # rows outside the quadrant layout are untouched (memset 0)
    assert scales[0, 0] == 0


def test_quantize_mx_rules():
    def kernel(src_dtype, p, dst_dtype):
        x = nl.ndarray((p, 16), src_dtype, buffer=nl.sbuf)
        nisa.quantize_mx(dst=nl.ndarray((p, 4), dst_dtype, buffer=nl.sbuf), src=x,
                         dst_scale=nl.ndarray((p, 4), nl.uint8, buffer=nl.sbuf))

    with pytest.raises(SimulationError, match="src must be bf16 or fp16"):
        run(lambda: kernel(nl.float32, 32, nl.float8_e4m3fn_x4))
    with pytest.raises(SimulationError, match="multiple of 32"):
        run(lambda: kernel(nl.bfloat16, 48, nl.float8_e4m3fn_x4))
    with pytest.raises(SimulationError, match="dst must be float8_e4m3fn_x4 or float8_e5m2_x4"):
        run(lambda: kernel(nl.bfloat16, 32, nl.float4_e2m1fn_x4))
    with pytest.raises(SimulationError, match="quantize_mx requires NeuronCore gen4"):
        run(lambda: kernel(nl.bfloat16, 32, nl.float8_e4m3fn_x4), target="trn2")


def _mx_mm_kernel(stat_dtype, mov_dtype):
    def kernel(s_hbm, v_hbm, ss_hbm, vs_hbm):
        s = nl.ndarray(s_hbm.shape, stat_dtype, buffer=nl.sbuf)
        v = nl.ndarray(v_hbm.shape, mov_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s.view(nl.uint32 if stat_dtype != nl.float4_e2m1fn_x4 else nl.uint16), src=s_hbm)
        nisa.dma_copy(dst=v.view(nl.uint32 if mov_dtype != nl.float4_e2m1fn_x4 else nl.uint16), src=v_hbm)
        ss, vs = sbuf_in(ss_hbm), sbuf_in(vs_hbm)
        acc = nl.ndarray((s.shape[1], v.shape[1]), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=acc, stationary=s, moving=v, stationary_scale=ss, moving_scale=vs)
        return hbm_out(acc)
    return kernel


@pytest.mark.parametrize("p,sfmt,vfmt", [(128, "e4m3fn", "e2m1"), (64, "e5m2", "e4m3fn"), (32, "e2m1", "e2m1")])
def test_nc_matmul_mx_matches_golden(rng, p, sfmt, vfmt):
    k, m, n = 4 * p, 32, 48
    ws = rng.standard_normal((k, m)).astype(np.float32)
    wv = rng.standard_normal((k, n)).astype(np.float32)
    sq, ss = mx_golden.quantize_for_matmul(ws, sfmt, rule="ocp", partitions=p)
    vq, vs = mx_golden.quantize_for_matmul(wv, vfmt, rule="ocp", partitions=p)
    dt = {"e4m3fn": nl.float8_e4m3fn_x4, "e5m2": nl.float8_e5m2_x4, "e2m1": nl.float4_e2m1fn_x4}
    scat = lambda s: mx_golden.scatter_scales_sbuf(s, partitions=p)
    out = run(_mx_mm_kernel(dt[sfmt], dt[vfmt]), sq, vq, scat(ss), scat(vs))
    ref = mx_golden.matmul_mx_golden(sq, vq, ss, vs, sfmt, vfmt, partitions=p)
    # same decoded operands; fp32 (simulator) vs fp64 (golden) accumulation order only
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_nc_matmul_mx_rules():
    def kernel(p, m, dtype=nl.float8_e4m3fn_x4, scale_rows=None):
        s = nl.ndarray((p, m), dtype, buffer=nl.sbuf)
        sc = nl.ndarray((scale_rows or p, m), nl.uint8, buffer=nl.sbuf)
        nisa.nc_matmul_mx(dst=nl.ndarray((m, m), nl.float32, buffer=nl.psum), stationary=s, moving=s,
                          stationary_scale=sc, moving_scale=sc)

    with pytest.raises(SimulationError, match="must be an x4 MX dtype"):
        run(lambda: kernel(32, 8, nl.bfloat16))
    with pytest.raises(SimulationError, match="partition count must be 32, 64, 96 or 128"):
        run(lambda: kernel(48, 8))
    with pytest.raises(SimulationError, match="must be even and <= 128"):
        run(lambda: kernel(32, 7))
    with pytest.raises(SimulationError, match="needs at least 100 partitions"):
        run(lambda: kernel(128, 8, scale_rows=64))
    with pytest.raises(SimulationError, match="nc_matmul_mx requires NeuronCore gen4"):
        run(lambda: kernel(32, 8), target="trn2")
