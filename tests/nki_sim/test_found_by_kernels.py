"""Simulator / cost-model issues found while writing the kernels of nki_kernels/.

Each test states the expected behaviour; a known open issue is marked `xfail(strict=True)` so that its fix flips it
(and the marker must then be removed).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from nki_kernels.sim import simulate_kernel
from nki_kernels.sim.cost import CostModel


@nki.jit
def _transpose_mode_kernel(x_hbm):
    out_hbm = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=x_hbm)
    ident = nl.shared_identity_matrix(128, dtype=nl.float32)
    t = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=t, stationary=x, moving=ident, is_transpose=True)
    o = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o, src=t)
    nisa.dma_copy(dst=out_hbm, src=o)
    return out_hbm


def test_transpose_mode_matmul_adds_no_matmul_flops():
    model = CostModel("trn2")
    x = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)
    out = simulate_kernel(_transpose_mode_kernel, (x,), recorder=model, target="trn2")
    np.testing.assert_array_equal(out, x.T)          # the simulator's transpose itself is right
    report = model.report()
    assert report.flops == 0.0                       # ... and no useful matmul work was done (fixed: was 2*K*M*N)
    assert report.matmul_mode == "none" and report.tensor_peak_fraction == 0.0
    assert report.engine_busy_s["tensor"] > 0        # but the TensorE time of the pass is still charged
