"""NKI kernels of neuron-infer, and the one place where ``import nki`` is resolved.

Importing ``nki_kernels`` makes ``import nki``, ``import nki.language as nl`` and ``import nki.isa as nisa`` work:
* if a genuine Neuron ``nki`` package is installed (it has ``nki.jit`` and the ``nki.isa``/``nki.language``
  submodules), it is left alone and kernels run through it;
* otherwise (absent, or the empty PyPI placeholder "nki" distribution) the NumPy simulator in
  ``nki_kernels/sim`` is registered as ``nki``, ``nki.language``, ``nki.isa``, ``nki.simulator``, ``nki.typing``,
  ``nki.compiler`` and ``nki.collectives``.
``nki_kernels.NKI_BACKEND`` says which one is in use ("neuron" or "simulator"). Set
``NKI_KERNELS_FORCE_SIMULATOR=1`` to use the simulator even where the Neuron SDK is installed (e.g. to run
tests/nki_sim on a Trn instance). torch is never imported here.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

_SUBMODULES = ("language", "isa", "simulator", "typing", "compiler", "collectives", "dtype")


def _is_simulator(module) -> bool:
    return getattr(module, "_IS_NKI_KERNELS_SIMULATOR", False)


def _placeholder_distribution() -> bool:
    """True when the installed ``nki`` distribution is the PyPI placeholder (0.0.x / "wrong package" stub)."""
    try:
        from importlib import metadata
        dist = metadata.distribution("nki")
    except Exception:  # noqa: BLE001 - no metadata: decide from the module itself
        return False
    text = " ".join(str(dist.metadata.get(k, "")) for k in ("Summary", "Description")).lower()
    return dist.version.startswith("0.0.") or "wrong package" in text or "placeholder" in text


def genuine_nki_available() -> bool:
    """Whether a real Neuron ``nki`` package (not a placeholder, not this simulator) can be imported."""
    loaded = sys.modules.get("nki")
    if loaded is not None:
        return not _is_simulator(loaded) and hasattr(loaded, "jit")
    if importlib.util.find_spec("nki") is None or _placeholder_distribution():
        return False
    try:
        module = importlib.import_module("nki")
        ok = hasattr(module, "jit") and all(importlib.util.find_spec(f"nki.{m}") is not None
                                            for m in ("language", "isa"))
    except Exception:  # noqa: BLE001 - a stub that fails to import is not a usable nki
        ok = False
    if not ok:
        for name in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
            del sys.modules[name]
    return ok


def _install_simulator() -> None:
    from .sim import nki as sim_nki

    sys.modules["nki"] = sim_nki
    for sub in _SUBMODULES:
        sys.modules[f"nki.{sub}"] = getattr(sim_nki, sub)
    sys.modules["nki.isa.constants"] = sim_nki.isa.constants


if os.environ.get("NKI_KERNELS_FORCE_SIMULATOR", "0") != "1" and genuine_nki_available():
    NKI_BACKEND = "neuron"
else:
    _install_simulator()
    NKI_BACKEND = "simulator"
