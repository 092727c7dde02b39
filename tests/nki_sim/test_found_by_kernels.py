"""Simulator / cost-model issues found while writing the kernels of nki_kernels/ (issue 4).

Each test states the expected behaviour; known open issues are `xfail(strict=True)` so that the fix flips them
(and the marker must then be removed).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

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


@pytest.mark.xfail(strict=True, reason="cost model counts an is_transpose=True nc_matmul (data movement) as "
                                       "2*K*M*N matmul FLOPs, inflating the Tensor Engine peak fraction")
def test_transpose_mode_matmul_adds_no_matmul_flops():
    model = CostModel("trn2")
    x = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)
    out = simulate_kernel(_transpose_mode_kernel, (x,), recorder=model, target="trn2")
    np.testing.assert_array_equal(out, x.T)          # the simulator's transpose itself is right
    assert model.report().flops == 0.0               # ... but no useful matmul work was done
