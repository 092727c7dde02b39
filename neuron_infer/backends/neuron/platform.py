"""The Neuron platform and logical-NeuronCore (LNC) degree a neuron compile targets. NOT YET RUN ON HARDWARE.

Resolution, in the order neuronx-distributed-inference uses (NeuronConfig._get_lnc):
  1. `NEURON_LOGICAL_NC_CONFIG` (the variable the Neuron runtime reads);
  2. `BuildConfig.lnc` (the Python API's build setting);
  3. the platform default: trn1/inf2 -> 1, trn2/trn3 -> 2. On trn2/trn3 neuronx-cc's `--logical-nc-config`
     and the runtime both default to 2 (neuronx-cc CLI reference), and a NEFF only runs on a runtime of the
     LNC it was compiled for.
The platform is `NEURON_PLATFORM_TARGET_OVERRIDE` when set, else `torch_neuronx.utils.get_platform_target()`
(the instance this process runs on). A compile sets `NEURON_PLATFORM_TARGET_OVERRIDE` to that platform while
it traces (when unset, as NxDI does for its NKI kernels): `nki.jit` compiles the kernels for it and our kernels
branch on `nisa.get_nc_version()`. Every graph gets `--lnc=<degree>`, the NKI kernels are launched with the same
grid, and the degree is recorded with each graph; loading refuses a runtime LNC that differs.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from neuron_infer.errors import ArtifactError, BackendUnavailableError, ConfigError

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
PLATFORM_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
# platform -> default LNC (NxD utils/model_utils.get_platform_lnc; neuronx-cc --logical-nc-config default on trn2)
PLATFORM_LNC = {"trn1": 1, "inf2": 1, "trn2": 2, "trn3": 2}
# the synonyms nki.jit documents for NEURON_PLATFORM_TARGET_OVERRIDE (trn1|inf2|gen2, trn2|gen3, trn3|gen4)
_SYNONYMS = {"gen2": "trn1", "trn1n": "trn1", "gen3": "trn2", "gen4": "trn3"}


@dataclass(frozen=True)
class NeuronTarget:
    platform: str  # trn1 | inf2 | trn2 | trn3
    lnc: int  # 1 or 2

    def compiler_args(self) -> list[str]:
        return [f"--lnc={self.lnc}"]

    def record(self) -> dict[str, Any]:
        """What the artifact records per graph (read back by `check_runtime`)."""
        return {"platform": self.platform, "lnc": self.lnc}


def _platform_name(value: str, source: str) -> str:
    name = _SYNONYMS.get(value.strip().lower(), value.strip().lower())
    if name not in PLATFORM_LNC:
        raise BackendUnavailableError(f"{source}={value!r} is not a Neuron platform; use one of "
                                      f"{', '.join(PLATFORM_LNC)}")
    return name


def platform_target(sdk: Any) -> str:
    """The platform from NEURON_PLATFORM_TARGET_OVERRIDE, else from torch-neuronx (the instance we run on)."""
    override = os.environ.get(PLATFORM_ENV, "").strip()
    if override:
        return _platform_name(override, PLATFORM_ENV)
    return _platform_name(str(sdk.utils.get_platform_target()), "torch_neuronx.utils.get_platform_target()")


def _degree(value: Any, source: str) -> int:
    text = str(value).strip()
    if text not in ("1", "2"):
        raise ConfigError(f"{source}={value!r} is not a logical NeuronCore degree; set it to 1 or 2")
    return int(text)


def resolve_lnc(platform: str, build_lnc: int | None) -> int:
    """NEURON_LOGICAL_NC_CONFIG, then the build's lnc, then the platform default."""
    env = os.environ.get(LNC_ENV, "").strip()
    if env:
        if build_lnc is not None and str(build_lnc) != env:  # NxDI's order and warning: the runtime reads the env
            warnings.warn(f"{LNC_ENV}={env} overrides the build's lnc={build_lnc}", UserWarning, stacklevel=2)
        return _degree(env, LNC_ENV)
    if build_lnc is not None:
        return _degree(build_lnc, "lnc")
    return PLATFORM_LNC[platform]


def resolve_target(sdk: Any, build_lnc: int | None) -> NeuronTarget:
    platform = platform_target(sdk)
    lnc = resolve_lnc(platform, build_lnc)
    if lnc == 2 and PLATFORM_LNC[platform] == 1:
        raise ConfigError(f"LNC 2 does not exist on {platform} (logical NeuronCores of 2 exist on trn2/trn3 only); "
                          f"unset {LNC_ENV} or set it to 1")
    return NeuronTarget(platform, lnc)


@contextlib.contextmanager
def compile_env(target: NeuronTarget) -> Iterator[None]:
    """NEURON_PLATFORM_TARGET_OVERRIDE = the target platform while tracing (left alone when already set)."""
    if os.environ.get(PLATFORM_ENV, "").strip():
        yield
        return
    os.environ[PLATFORM_ENV] = target.platform
    try:
        yield
    finally:
        os.environ.pop(PLATFORM_ENV, None)


def check_runtime(record: dict[str, Any], where: str) -> None:
    """Before loading a NEFF: the runtime's LNC must be the compiled one. An unset NEURON_LOGICAL_NC_CONFIG is set
    to the recorded degree (the runtime reads it when it starts); a different value is refused."""
    if "lnc" not in record:
        raise ArtifactError(f"{where} does not record its logical NeuronCore degree; recompile the model")
    lnc = int(record["lnc"])
    env = os.environ.get(LNC_ENV, "").strip()
    if env and env != str(lnc):
        raise ArtifactError(f"{where} was compiled for LNC {lnc} but {LNC_ENV}={env}; set {LNC_ENV}={lnc} "
                            "or recompile with this LNC")
    os.environ[LNC_ENV] = str(lnc)
