"""Shared helpers for the NKI simulator tests: importing nki_kernels registers the simulator as ``nki``."""
from __future__ import annotations

import numpy as np
import pytest

import nki_kernels  # noqa: F401  (resolution: nki -> simulator)
from nki_kernels.sim import ListRecorder, simulate_kernel


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
