"""Simulator implementation of the top-level ``nki`` package (NKI 0.6/0.7 API subset; the NKI documentation A.1).

Registered as ``sys.modules["nki"]`` by ``import nki_kernels`` when no genuine Neuron ``nki`` is installed. Public
names are those of the real package (nki_kernels/sim/api_table.json); simulator-only helpers live in
``nki.simulator``.
"""
from ..launch import jit, simulate
from . import collectives, compiler, dtype, isa, language, simulator, typing

__version__ = "0.7.0+numpy-sim"  # runs 0.6 kernels too (nki_kernels/sim/api_version.py)
_IS_NKI_KERNELS_SIMULATOR = True

__all__ = ["collectives", "compiler", "dtype", "isa", "jit", "language", "simulate", "simulator", "typing"]
