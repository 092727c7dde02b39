"""MX matmul kernel vs the mx_golden oracle (same quantization on both sides) and vs the float matmul."""
from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.mx_matmul.kernel import mx_matmul_kernel
from nki_kernels.mx_matmul.reference import dequantized_weight, mx_matmul_reference, pack_mx_weight, pad_k
from nki_kernels.sim import SimulationError

from .conftest import BF16, run


@pytest.mark.parametrize("fmt,n_tok,k,f", [
    ("e4m3fn", 3, 512, 200),       # decode: odd token count (padded to an even stationary), F % 512 != 0
    ("e2m1", 130, 1024, 640),      # MXFP4, two contraction tiles, partial token and output tiles
    ("e4m3fn", 2100, 300, 64),     # two token blocks (2048 + 52); K = 300 zero-padded to 512
    ("e4m3fn", 5, 4096, 1100),     # T = 8: weight DMAs of 2 F tiles -> groups [0, 1024) + [1024, 1100)
])
def test_mx_matmul_matches_golden(rng, fmt, n_tok, k, f):
    x = pad_k(rng.standard_normal((n_tok, k)).astype(BF16), axis=1)       # [N, Kp]
    w = (rng.standard_normal((k, f)) / np.sqrt(k)).astype(np.float32)
    words, scales = pack_mx_weight(w, fmt)
    out = run(mx_matmul_kernel, x, words, scales).astype(np.float64)
    assert np.isfinite(out).all(), "output elements never written (NaN poison)"
    ref = mx_matmul_reference(x, words, scales, fmt).astype(np.float64)
    # identical quantized operands: the only differences are the fp32 summation order over K and the single
    # bf16 rounding of the output (half an ulp = 2^-9 relative; 2^-8 allows a tie flip + fp32 noise)
    np.testing.assert_allclose(out, ref, rtol=2.0 ** -8, atol=1e-5 * np.abs(ref).max())


def test_mx_weight_packing_round_trips_within_the_format_error(rng):
    w = rng.standard_normal((512, 96)).astype(np.float32)
    for fmt, bound in (("e4m3fn", 2.0 ** -3), ("e2m1", 2.0 ** -1)):
        words, scales = pack_mx_weight(w, fmt)
        deq = dequantized_weight(words, scales, fmt)
        # per-block: error <= half a step of the element format relative to the block max (3 / 1 mantissa bits)
        assert np.abs(deq - w).max() <= bound * np.abs(w).max(), fmt
        assert deq.shape == w.shape


def test_mx_matmul_needs_gen4(rng):
    x = np.zeros((2, 512), BF16)
    words, scales = pack_mx_weight(np.zeros((512, 8), np.float32), "e4m3fn")
    with pytest.raises(SimulationError, match="gen4"):
        run(mx_matmul_kernel, x, words, scales, target="trn2")
