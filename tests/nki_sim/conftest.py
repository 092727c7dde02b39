"""Shared helpers for the NKI simulator tests: importing nki_kernels registers the simulator as ``nki``."""
from __future__ import annotations

import numpy as np
import pytest

import nki_kernels
from nki_kernels.sim import ListRecorder, simulate_kernel


def pytest_collection_modifyitems(config, items):
    """With a genuine Neuron `nki` installed, these simulator tests need NKI_KERNELS_FORCE_SIMULATOR=1."""
    if nki_kernels.NKI_BACKEND == "simulator":
        return
    skip = pytest.mark.skip(reason="a genuine nki is installed; set NKI_KERNELS_FORCE_SIMULATOR=1 to test the simulator")
    for item in items:
        if "nki_sim" in item.nodeid and "test_resolution" not in item.nodeid:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def run(kernel, *args, target="trn3", lnc=None, recorder=None, execute=True, **kwargs):
    """Run ``kernel(*args, **kwargs)`` on the simulator for ``target``."""
    return simulate_kernel(kernel, args, kwargs, lnc=lnc, recorder=recorder, execute=execute, target=target)


def run_events(kernel, *args, target="trn3", **kwargs):
    rec = ListRecorder()
    out = run(kernel, *args, target=target, recorder=rec, **kwargs)
    return out, rec.events


def sbuf_in(x_hbm, dtype=None, buffer=None):
    """Test helper (usable inside a simulated kernel): DMA an HBM tensor into a fresh SBUF tile."""
    import nki.isa as nisa
    import nki.language as nl

    t = nl.ndarray(x_hbm.shape, dtype or x_hbm.dtype, buffer=buffer or nl.sbuf)
    if t.buffer is nl.psum:
        s = nl.ndarray(x_hbm.shape, x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=x_hbm)
        nisa.tensor_copy(dst=t, src=s)
    else:
        nisa.dma_copy(dst=t, src=x_hbm)
    return t


def hbm_out(t, dtype=None):
    """Test helper: copy an on-chip tile (SBUF or PSUM) to a new shared_hbm output."""
    import nki.isa as nisa
    import nki.language as nl

    out = nl.ndarray(t.shape, dtype or t.dtype, buffer=nl.shared_hbm)
    if t.buffer is nl.psum:
        s = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=t)
        t = s
    nisa.dma_copy(dst=out, src=t)
    return out
