"""The op table of a build: `get_ops(BuildConfig.kernels)` -> Ops ('reference': plain PyTorch, the oracle; 'nki':
the NKI kernels, through the simulator on CPU or the SDK on Neuron)."""
from __future__ import annotations

from collections.abc import Callable

from neuron_infer.errors import ConfigError
from neuron_infer.model import nki_ops
from neuron_infer.model.ops import Ops


def _reference_ops() -> Ops:
    return Ops(name="reference", gqa_fold=True)


_REGISTRY: dict[str, Callable[[], Ops]] = {"reference": _reference_ops, "nki": nki_ops.build_ops}


def get_ops(kernels: str) -> Ops:
    """Return the op table for `BuildConfig.kernels` ('reference' | 'nki')."""
    if kernels not in _REGISTRY:
        raise ConfigError(f"kernels={kernels!r} is unknown; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[kernels]()
