"""Fused MLP kernels (float and FP8 weights, with/without RMSNorm) vs the float64 oracle (tolerances: conftest.TOL)."""
from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.mlp.kernel import mlp_fp8_kernel, mlp_kernel, rmsnorm_mlp_fp8_kernel, rmsnorm_mlp_kernel
from nki_kernels.mlp.reference import mlp_reference, pack_scales, pack_weight, quantize_fp8_weight

from .conftest import BF16, check, kind_of, run

EPS = 1e-5


def _inputs(rng, n_tok, hidden, inter, dtype):
    x = rng.standard_normal((n_tok, hidden)).astype(dtype)
    wg = (rng.standard_normal((hidden, inter)) / np.sqrt(hidden)).astype(dtype)   # [H, I] = gate.weight.T
    wu = (rng.standard_normal((hidden, inter)) / np.sqrt(hidden)).astype(dtype)
    wd = (rng.standard_normal((inter, hidden)) / np.sqrt(inter)).astype(dtype)    # [I, H]
    gamma = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    return x, gamma, (wg, wu, wd)


@pytest.mark.parametrize("n_tok,hidden,inter,dtype,norm", [
    (5, 200, 300, np.float32, False),     # decode shape, H and I not multiples of 128
    (5, 200, 300, np.float32, True),
    (130, 256, 128, BF16, True),          # prefill with a partial 128-token tile
    (600, 64, 96, np.float32, False),     # two 512-token blocks
    (3, 160, 256, BF16, False),
    (3, 1024, 384, np.float32, False),    # several weight-slab DMA groups (gate/up: 2 + 1 chunks, down: 6 + 2)
    (131, 256, 128, BF16, False),         # x by DMA transpose (bf16, no norm, H % 128 == 0), 128 + 3 tokens
])
def test_float_mlp_matches_reference(rng, n_tok, hidden, inter, dtype, norm):
    x, gamma, w = _inputs(rng, n_tok, hidden, inter, dtype)
    tiled = [pack_weight(a) for a in w]
    if norm:
        out = run(rmsnorm_mlp_kernel, x, gamma, EPS, *tiled)
        ref = mlp_reference(x, *w, gamma=gamma, eps=EPS)
    else:
        out = run(mlp_kernel, x, *tiled)
        ref = mlp_reference(x, *w)
    check(out, ref, kind_of(dtype))


@pytest.mark.parametrize("n_tok,hidden,inter,dtype,norm", [
    (3, 160, 256, BF16, True),
    (130, 256, 200, BF16, False),
    (7, 128, 128, np.float32, False),     # fp32 activations are cast to bf16 for the FP8 matmuls
])
def test_fp8_mlp_matches_reference(rng, n_tok, hidden, inter, dtype, norm):
    x, gamma, w = _inputs(rng, n_tok, hidden, inter, dtype)
    q = [quantize_fp8_weight(a) for a in w]            # (E4M3 codes [K, N], scale [N]) per projection
    args = [pack_weight(c) for c, _ in q] + [pack_scales(s) for _, s in q]
    codes, scales = [c for c, _ in q], [s for _, s in q]
    if norm:
        out = run(rmsnorm_mlp_fp8_kernel, x, gamma, EPS, *args, target="trn2")
        ref = mlp_reference(x, *codes, scales=scales, gamma=gamma, eps=EPS)
    else:
        out = run(mlp_fp8_kernel, x, *args, target="trn2")
        ref = mlp_reference(x, *codes, scales=scales)
    # the oracle uses the same FP8 codes and scales, so only the bf16 activation roundings differ
    check(out, ref, "bf16")


def test_fp8_quantization_error_is_bounded(rng):
    """Host quantizer: |dequant - w| <= half an E4M3 ulp (2^-4 relative) + the subnormal step."""
    w = rng.standard_normal((64, 40)).astype(np.float32)
    codes, scale = quantize_fp8_weight(w)
    assert np.abs(codes.astype(np.float32)).max() <= 240.0
    deq = codes.astype(np.float32) * scale
    assert (np.abs(deq - w) <= scale * np.maximum(np.abs(w / scale) * 2.0 ** -4, 2.0 ** -10) + 1e-7).all()


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_bf16_mlp_x_layout_paths_agree_with_reference(rng, target):
    """bf16 x without RMSNorm: DMA transpose on gen3+, TensorE transposes on gen2 (no DMA transpose there)."""
    x, _, w = _inputs(rng, 9, 384, 128, BF16)
    out = run(mlp_kernel, x, *(pack_weight(a) for a in w), target=target)
    check(out, mlp_reference(x, *w), "bf16")
