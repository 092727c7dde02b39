"""Which NKI API version the simulator enforces: 0.6 (Neuron SDK 2.32), 0.7 (SDK 2.33), or both (the default).

NKI 0.7 ("Migrating from NKI 0.6.0 to NKI 0.7.0", Neuron SDK 2.33 documentation) specializes kernels by tracing
them in Python, removes ``nl.dynamic_range`` and ``while`` on a register (use ``nl.fori_loop`` /
``nl.while_loop``), adds ``nisa.NkiScalar`` (``nisa.scalar_load`` / ``nisa.scalar_store``; "only the tracer
frontend supports this") and has the compiler reject a kernel whose LNC degree differs from neuronx-cc's
(error NCC_EVRF066). ``NKI_COMPILER_FRONTEND=custom`` keeps the 0.6 specialization in SDK 2.33 (deprecated there).

``NKI_SIMULATOR_API`` selects the rules:
* unset: both APIs run (a 0.6 kernel's ``nl.dynamic_range`` and a 0.7 kernel's ``NkiScalar``); the 0.7 LNC check
  applies. Use ``nki_kernels.sim.real_api.check_source(source, version)`` to prove a kernel valid under one API;
* ``0.7``: 0.6-only constructs raise, ``fori_loop`` bodies receive an ``NkiScalar`` (or a ``VirtualRegister`` when a
  bound is one), as the 2.33 API reference states;
* ``0.6``: 0.7-only constructs raise, the LNC degrees are not compared. ``NKI_COMPILER_FRONTEND=custom`` (with
  ``NKI_SIMULATOR_API`` unset) selects these rules too.
"""
from __future__ import annotations

import os

from .errors import SimulationError

API_ENV = "NKI_SIMULATOR_API"
FRONTEND_ENV = "NKI_COMPILER_FRONTEND"
VERSIONS = ("0.6", "0.7")


def api_version() -> str | None:
    """'0.6', '0.7', or None (both accepted)."""
    value = os.environ.get(API_ENV, "").strip()
    if value:
        if value not in VERSIONS:
            raise SimulationError(f"{API_ENV}={value!r}: use one of {', '.join(VERSIONS)} (or leave it unset for both)")
        return value
    if os.environ.get(FRONTEND_ENV, "").strip().lower() == "custom":
        return "0.6"
    return None


def removed_in_07(construct: str, replacement: str) -> None:
    """A 0.6 construct the 0.7 tracer removed: raises under the 0.7 rules."""
    if api_version() == "0.7":
        raise SimulationError(f"{construct} was removed in NKI 0.7 (Neuron SDK 2.33); use {replacement} "
                              f"(NKI_COMPILER_FRONTEND=custom keeps the 0.6 specialization)")


def added_in_07(construct: str) -> None:
    """A 0.7 construct (tracer frontend only): raises under the 0.6 rules."""
    if api_version() == "0.6":
        raise SimulationError(f"{construct} needs NKI 0.7 (Neuron SDK 2.33) and its tracer frontend; the 0.6 / "
                              f"NKI_COMPILER_FRONTEND=custom specialization rejects it")
