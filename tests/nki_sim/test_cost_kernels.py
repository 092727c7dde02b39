"""Cost model end to end: real NKI kernels run through the simulator, their events costed.

* the two calibration GEMM kernels compute the right numbers (tiny shapes, executed);
* their instruction streams are exactly the synthetic streams of test_cost_calibration.py (tiny shapes), which is
  what makes the synthetic calibration meaningful;
* at the published shape (bf16 [4096, 8192] @ [8192, 8192], Trn1) in cost-only mode the real kernels land in the
  same bands as the synthetic streams (bands and reasons in test_cost_calibration.py).
"""
import ml_dtypes
import numpy as np
import pytest
from nki.simulator import ShapeSpec, simulate_kernel

import nki_kernels  # noqa: F401  (makes `nki` resolve to the simulator here)
from nki_kernels.examples.gemm_blocked import gemm_blocked
from nki_kernels.examples.gemm_naive import gemm_naive
from nki_kernels.examples.mx_matmul import mx_matmul_kernel
from nki_kernels.examples.tensor_add import tensor_add_kernel
from nki_kernels.sim import cost_constants as C
from nki_kernels.sim.cost import CostModel, cost_kernel, estimate
from nki_kernels.sim.events import ListRecorder

from .test_cost_calibration import PUBLISHED_BLOCKED, PUBLISHED_NAIVE, blocked_gemm_events, naive_gemm_events

BF16 = ml_dtypes.bfloat16


TRN1 = "trn1"  # the generation of the published calibration figures


def _operands(K, M, N, seed=0):
    rng = np.random.default_rng(seed)
    lhsT = rng.standard_normal((K, M)).astype(BF16)  # [K, M] = A transposed
    rhs = rng.standard_normal((K, N)).astype(BF16)   # [K, N]
    return lhsT, rhs


@pytest.mark.parametrize("kernel,shape", [(gemm_naive, (256, 256, 1024)), (gemm_blocked, (256, 512, 1024))])
def test_gemm_kernels_match_numpy(kernel, shape):
    K, M, N = shape
    lhsT, rhs = _operands(K, M, N)
    out = simulate_kernel(kernel, (lhsT, rhs), {}, target=TRN1)
    ref = lhsT.astype(np.float32).T @ rhs.astype(np.float32)   # [M, N], fp32 accumulation like PSUM
    # Tolerance: PSUM accumulates in fp32 (summation order differs from NumPy's, ~1e-6 relative) and the result is
    # rounded once to bf16 (relative error <= 2^-8 = 0.39%); 1% of the output's scale covers both with margin.
    assert out.shape == (M, N) and out.dtype == BF16
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=0, atol=0.01 * np.abs(ref).max())


@pytest.mark.parametrize("kernel,synthetic,shape", [
    (gemm_naive, naive_gemm_events, (256, 256, 1024)),
    (gemm_blocked, blocked_gemm_events, (256, 1024, 2048)),
])
def test_kernel_stream_is_the_synthetic_stream(kernel, synthetic, shape):
    K, M, N = shape
    rec = ListRecorder()
    simulate_kernel(kernel, _operands(K, M, N), {}, recorder=rec, execute=False, target=TRN1)
    assert rec.events == list(synthetic(K, M, N))


@pytest.mark.slow  # ~5-10 s each: 37k / 99k instructions through the interpreter (cost-only mode)
@pytest.mark.parametrize("kernel,published", [(gemm_blocked, PUBLISHED_BLOCKED), (gemm_naive, PUBLISHED_NAIVE)])
def test_calibration_shape_on_real_kernels(kernel, published):
    K, M, N = 8192, 4096, 8192
    model = CostModel(None)          # generation taken from the run: trn1
    lhsT, rhs = ShapeSpec((K, M), BF16), ShapeSpec((K, N), BF16)   # shapes only: cost-only mode
    simulate_kernel(kernel, (lhsT, rhs), {}, recorder=model, execute=False, target=TRN1)
    rep = model.report()
    assert rep.generation == "gen2" and rep.flops == 2 * K * M * N
    synthetic = blocked_gemm_events if kernel is gemm_blocked else naive_gemm_events
    assert rep.to_dict() == estimate(synthetic(K, M, N), "gen2").to_dict()
    assert rep.tensor_peak_fraction_serial <= published <= rep.tensor_peak_fraction, str(rep)
    if kernel is gemm_blocked:
        assert 0.70 <= rep.tensor_peak_fraction <= 0.95 and rep.bound_engine == "tensor", str(rep)
    else:
        assert rep.tensor_peak_fraction <= 0.35 and rep.bound_engine == "dma", str(rep)


def test_large_elementwise_example_is_dma_bound():
    # the simulator's canonical tensor-add example on a 8192 x 8192 bf16 pair, every generation
    spec = ShapeSpec((8192, 8192), BF16)
    for gen in ("trn1", "trn2", "trn3"):
        rep = cost_kernel(tensor_add_kernel, (spec, spec), generation=gen)
        assert rep.generation == C.resolve_generation(gen)
        assert rep.bound_engine == "dma", str(rep)
        assert rep.hbm_bytes == 3 * 8192 * 8192 * 2          # a, b read once, out written once
        assert rep.engine_instructions["vector"] == 8192 // 128


def test_lnc2_programs_are_separate_cores():
    # Both LNC2 program instances of this example do the whole (un-split) work: per-core busy time must equal the
    # LNC1 run's (not double it), and the bandwidth fraction is over two cores' HBM share, i.e. halved.
    spec = ShapeSpec((1024, 2048), BF16)
    reports = []
    for lnc in (1, 2):
        model = CostModel("trn2")
        simulate_kernel(tensor_add_kernel, (spec, spec), {}, lnc=lnc, recorder=model, execute=False, target="trn2")
        reports.append(model.report())
    one, two = reports
    assert (one.cores, two.cores) == (1, 2)
    assert two.engine_busy_s == one.engine_busy_s and two.lower_bound_s == one.lower_bound_s
    assert two.hbm_bytes == 2 * one.hbm_bytes
    assert two.hbm_bw_fraction == pytest.approx(one.hbm_bw_fraction, rel=1e-12)  # 2x bytes over 2x bandwidth


def test_mx_example_reports_mx_peak():
    # gen4 MX example with P=128, M=128, N=512 (bf16 inputs [128, 4M] / [128, 4N] in quad layout)
    model = CostModel("trn3")
    args = (ShapeSpec((128, 4 * 128), BF16), ShapeSpec((128, 4 * 512), BF16))
    simulate_kernel(mx_matmul_kernel, args, {}, recorder=model, execute=False, target="trn3")
    rep = model.report()
    # one nc_matmul_mx with logical K = 4 x 128 = 512: FLOPs = 2 * 512 * 128 * 512
    assert rep.matmul_mode == "mx" and rep.flops == 2 * 512 * 128 * 512
    # TensorE: max(min(64, 128), 512) + 60 = 572 cycles at 2.4 GHz
    assert rep.engine_busy_s["tensor"] == pytest.approx(572 / 2.4e9, rel=1e-12)
    # VectorE: quantize_mx at 4 elems/partition/cycle on 512 and 2048 bf16 elems: (128 + 60) + (512 + 60) cycles,
    # plus the PSUM eviction tensor_copy of [128, 512] fp32: 512 + 60 cycles; all at 1.2 GHz
    assert rep.engine_busy_s["vector"] == pytest.approx((188 + 572 + 572) / 1.2e9, rel=1e-12)
