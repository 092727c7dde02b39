"""The canonical example kernels run on the simulator and match NumPy references."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from neuron_infer.quant import mx_golden
from nki_kernels.examples.causal_mask import causal_mask_kernel
from nki_kernels.examples.gemm import gemm_kernel
from nki_kernels.examples.mx_matmul import mx_matmul_kernel
from nki_kernels.examples.rmsnorm import rmsnorm_kernel
from nki_kernels.examples.softmax import softmax_kernel
from nki_kernels.examples.tensor_add import tensor_add_kernel

from .conftest import run

BF16 = ml_dtypes.bfloat16
FP32_MIN = np.finfo(np.float32).min


@pytest.mark.parametrize("rows", [128, 200])
def test_tensor_add_matches_numpy(rng, rows):
    a = rng.standard_normal((rows, 96)).astype(np.float32)
    b = rng.standard_normal((rows, 96)).astype(np.float32)
    out = run(tensor_add_kernel, a, b)
    np.testing.assert_array_equal(out, a + b)   # one fp32 add per element: exact


def test_tensor_add_bf16_rounds_once(rng):
    a = rng.standard_normal((64, 40)).astype(BF16)
    b = rng.standard_normal((64, 40)).astype(BF16)
    out = run(tensor_add_kernel, a, b)
    ref = (a.astype(np.float32) + b.astype(np.float32)).astype(BF16)   # fp32 arithmetic, cast on write
    np.testing.assert_array_equal(out.view(np.uint16), ref.view(np.uint16))


@pytest.mark.parametrize("k,m,n", [(256, 128, 512), (200, 72, 600)])
def test_gemm_fp32_matches_numpy(rng, k, m, n):
    lhsT = rng.standard_normal((k, m)).astype(np.float32)
    rhs = rng.standard_normal((k, n)).astype(np.float32)
    out = run(gemm_kernel, lhsT, rhs)
    # fp32 accumulation in a different order than float64 NumPy: relative error ~ sqrt(K) * eps
    np.testing.assert_allclose(out, lhsT.astype(np.float64).T @ rhs, rtol=1e-4, atol=1e-4)


def test_gemm_bf16_output_is_one_rounding_of_fp32(rng):
    lhsT = rng.standard_normal((128, 64)).astype(BF16)
    rhs = rng.standard_normal((128, 128)).astype(BF16)
    out = run(gemm_kernel, lhsT, rhs)
    exact = lhsT.astype(np.float64).T @ rhs.astype(np.float64)
    # bf16 output: half an ulp of bf16 (2^-8 relative) plus fp32 accumulation noise
    np.testing.assert_allclose(out.astype(np.float32), exact, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("rows,cols", [(128, 64), (130, 300)])
def test_softmax_matches_numpy(rng, rows, cols):
    x = (rng.standard_normal((rows, cols)) * 4).astype(np.float32)
    out = run(softmax_kernel, x)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)  # fp32 exp/sum


@pytest.mark.parametrize("rows", [128, 77])
def test_rmsnorm_matches_numpy(rng, rows):
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    g = rng.standard_normal(256).astype(np.float32)
    out = run(rmsnorm_kernel, x, g, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * g
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)  # fp32 sum of 256 squares


@pytest.mark.parametrize("sq,sk", [(256, 1024), (200, 700)])
def test_causal_mask_matches_numpy(rng, sq, sk):
    s = rng.standard_normal((sq, sk)).astype(np.float32)
    out = run(causal_mask_kernel, s)
    q, k = np.indices((sq, sk))
    np.testing.assert_array_equal(out, np.where(q >= k, s, FP32_MIN))


@pytest.mark.parametrize("p,m,n", [(128, 64, 256), (32, 16, 40), (96, 8, 32)])
def test_mx_matmul_matches_golden(rng, p, m, n):
    k = 4 * p
    w_stat = (rng.standard_normal((k, m)) * rng.uniform(0.01, 50, size=(1, m))).astype(BF16)   # [K, M]
    w_mov = rng.standard_normal((k, n)).astype(BF16)                                           # [K, N]
    # quad layout: [K, F] -> [4, P, F] -> [P, F, 4] -> [P, F*4]; element [p, f*4+q] = w[q*P + p, f]
    quad = lambda w: np.ascontiguousarray(w.reshape(4, p, -1).transpose(1, 2, 0).reshape(p, -1))
    out = run(mx_matmul_kernel, quad(w_stat), quad(w_mov))
    sq_, ss_ = mx_golden.quantize_for_matmul(w_stat, "e4m3fn", rule="nki", partitions=p)
    vq_, vs_ = mx_golden.quantize_for_matmul(w_mov, "e4m3fn", rule="nki", partitions=p)
    ref = mx_golden.matmul_mx_golden(sq_, vq_, ss_, vs_, "e4m3fn", "e4m3fn", partitions=p)
    # identical quantised operands; only fp32 (simulator) vs fp64 (golden) accumulation order differs
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # and the MX result is close to the unquantised product (MXFP8 e4m3: 3 mantissa bits per element)
    exact = w_stat.astype(np.float64).T @ w_mov.astype(np.float64)
    assert np.abs(out - exact).max() <= 0.1 * np.abs(exact).max()
