"""Simulator implementation of the top-level ``nki`` package (NKI 0.6/0.7 API subset; nki-reference.md A.1).

Registered as ``sys.modules["nki"]`` by ``import nki_kernels`` when no genuine Neuron ``nki`` is installed.
"""
from __future__ import annotations

from ..launch import Kernel, ShapeSpec, jit, simulate
from . import collectives, compiler, isa, language, simulator, typing

__version__ = "0.6.0+numpy-sim"
IS_NKI_KERNELS_SIMULATOR = True

__all__ = [
           "Kernel",
           "ShapeSpec",
           "collectives",
           "compiler",
           "isa",
           "jit",
           "language",
           "simulate",
           "simulator",
           "typing",
]
