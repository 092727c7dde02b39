"""The poison that `check` relies on: outputs the kernel does not write stay NaN."""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np

from .conftest import run


@nki.jit
def _writes_first_row_only(x_hbm):
    out_hbm = nl.ndarray(x_hbm.shape, dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    row = nl.ndarray((1, x_hbm.shape[1]), dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=x_hbm[0:1, :])
    nisa.dma_copy(dst=out_hbm[0:1, :], src=row)
    return out_hbm


def test_unwritten_output_elements_are_nan():
    out = run(_writes_first_row_only, np.ones((3, 4), np.float32))
    assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all()
