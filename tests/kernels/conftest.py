"""Helpers for the NKI kernel tests: run on the simulator, tolerance checks with declared reasons.

Poisoning: the simulator fills every fresh tensor (kernel outputs included) with NaN (ints with 4), like the
Neuron simulator. A kernel output that is finite everywhere therefore had every element written; `check`
asserts that before comparing values (test_poison.py proves the poisoning itself).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki_kernels  # noqa: F401  (registers the simulator as `nki`)
from nki_kernels.sim import simulate_kernel

BF16 = ml_dtypes.bfloat16

# Declared tolerances (max-abs error relative to max|ref|, RMS error relative to RMS(ref)) per dtype.
# fp32: every kernel computes in fp32 with fp32 PSUM accumulation; vs the float64 oracle the error is fp32
#   rounding of exp / sums / dot products over <= a few thousand terms: ~1e-6 relative, asserted at 2e-5.
# bf16: inputs are exact bf16 values given to both sides; the kernel rounds intermediates it stores in bf16
#   (attention: P before the PV matmul; MLP: normalised x and silu(g)*u; MX: the output) at 2^-9 relative each,
#   plus the bf16 output (2^-9). Up to four such roundings stack (RMSNorm MLP: x*inv_rms, *gamma, silu*up,
#   output), each propagating ~2^-9 relative through the following dot products. Max error <= 2^-6 * max|ref|
#   (8x one rounding of the largest output) and RMS error <= 2^-7 * RMS(ref) (4 roundings of 2^-9).
#   A single wrong element or tile is an O(1) relative error and fails both.
TOL = {"fp32": (2e-5, 2e-5), "bf16": (2.0 ** -6, 2.0 ** -7)}


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def run(kernel, *args, target="trn3"):
    return simulate_kernel(kernel, args, target=target)


def check(out, ref, kind):
    """Assert `out` is fully written (no NaN poison left) and within the declared tolerance of `ref`."""
    out64 = np.asarray(out).astype(np.float64)
    assert out64.shape == ref.shape, (out64.shape, ref.shape)
    assert np.isfinite(out64).all(), f"{np.isnan(out64).sum()} output elements never written (NaN poison)"
    max_rel, rms_rel = TOL[kind]
    err = np.abs(out64 - ref)
    scale = np.abs(ref).max()
    assert err.max() <= max_rel * scale, f"max error {err.max():.3g} > {max_rel:.3g} * {scale:.3g}"
    rms = np.sqrt((err ** 2).mean())
    assert rms <= rms_rel * np.sqrt((ref ** 2).mean()) + 1e-12, f"rms error {rms:.3g}"


def kind_of(dtype):
    return "bf16" if np.dtype(dtype) == np.dtype(BF16) else "fp32"


def pytest_collection_modifyitems(config, items):
    """Our kernels must not over-subscribe SBUF/PSUM nor accumulate into unwritten PSUM: SimulatorWarning fails."""
    for item in items:
        item.add_marker(pytest.mark.filterwarnings("error::nki_kernels.sim.errors.SimulatorWarning"))
