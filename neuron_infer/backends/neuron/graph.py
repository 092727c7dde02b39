"""Neuron backend: one NEFF per (sub-model, bucket) through torch-neuronx. NOT YET RUN ON HARDWARE.

Written against the documented torch-neuronx API (`torch_neuronx.trace`, `replace_weights`,
`move_trace_to_device`; the signatures our test double enforces are in tests/compile/neuron_sdk_signatures.py)
and exercised in CI through that recording double. The SDK is imported lazily, only when this backend is used.

    compile: torch_neuronx.trace(step, example_args, compiler_workdir=<temporary>, inline_weights_to_neff=False,
                                 compiler_args=[..., "--lnc=N"])   -> torch.jit.save(graphs/<name>.pt)
             through the NEFF cache (backends/neuron/cache.py); the buckets a compile misses are traced in parallel
             worker processes (compile/neuron_workers.py)
    load:    torch.jit.load(graphs/<name>.pt); torch_neuronx.replace_weights(graph, weights);
             torch_neuronx.move_trace_to_device(graph, 0)

The platform and logical-NeuronCore degree come from `backends/neuron/platform.py` (environment, then the build,
then the platform default); the compile runs with NEURON_PLATFORM_TARGET_OVERRIDE set to the platform, and each
graph's `graphs/<name>.neuron.json` records both, checked against the runtime before the graph is loaded.
With `--kernels nki` the step is traced under `nki_neuron.neuron_target(lnc=N)`, so the NKI kernels are launched
through the SDK's `nki.jit` as custom calls inside the graph, with the grid neuronx-cc compiles for.

Weights stay outside the NEFFs (`inline_weights_to_neff=False`) so every bucket graph is bound to the one weight
file of the artifact. The torch-neuronx docs say such a trace keeps its weights on the host (copied to the
device on every call) until `move_trace_to_device(trace, device_id)` moves them; each loaded graph is moved to
NeuronCore 0 (the first core visible to this process, NEURON_RT_VISIBLE_CORES) right after its weights are bound.
Traced graphs cannot mutate their inputs, so the step is traced in functional form (caches in, updated caches
out) and the loaded callable copies the result back into the engine's cache tensors.
"""
from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neuron_infer.backends.graph_cache import cached_compile
from neuron_infer.backends.neuron.cache import neff_cache_root, neff_key
from neuron_infer.backends.neuron.platform import NeuronTarget, check_runtime, compile_env, resolve_target
from neuron_infer.backends.neuron.support import preflight
from neuron_infer.errors import ArtifactError, BackendUnavailableError
from neuron_infer.model.nki_neuron import neuron_target

INSTALL_HINT = (
    "the neuron target needs the AWS Neuron SDK (torch-neuronx and neuronx-cc) installed from the Neuron pip "
    "repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx neuronx-cc) on a "
    "Trn1/Inf2/Trn2/Trn3 instance; the PyPI packages of those names are empty placeholders. Use --target cpu here."
)
COMPILER_ARGS = ("--model-type=transformer", "--auto-cast=none", "-O1")
DEVICE_ID = 0  # NeuronCore index for move_trace_to_device: the first core visible to this process
SDK_FUNCTIONS = ("trace", "replace_weights", "move_trace_to_device")


def import_sdk() -> Any:
    """Return the torch_neuronx module, or raise one clear sentence when it is absent or a placeholder."""
    try:
        sdk = importlib.import_module("torch_neuronx")
    except ImportError as e:
        raise BackendUnavailableError(INSTALL_HINT) from e
    if not all(callable(getattr(sdk, f, None)) for f in SDK_FUNCTIONS):
        raise BackendUnavailableError("the installed torch_neuronx is a placeholder without trace(); " + INSTALL_HINT)
    return sdk


class FunctionalStep(torch.nn.Module):
    """A bucket step whose cache updates are returned instead of applied in place (traceable by torch-neuronx)."""

    def __init__(self, step: torch.nn.Module, lnc: int):
        super().__init__()
        self.step, self.lnc = step, lnc

    def forward(self, input_ids, positions, k_cache, v_cache, logit_index, *tables):
        k, v = k_cache.clone(), v_cache.clone()  # [L, N, Hkv, bs, D] each
        with neuron_target(lnc=self.lnc):  # kernels="nki": the SDK's nki.jit with the compiled LNC grid
            logits = self.step(input_ids, positions, k, v, logit_index, *tables)  # [B, n, V]
        return logits, k, v


class NeuronBackend:
    name = "neuron"

    def __init__(self, sdk: Any | None = None):
        self.sdk = sdk or import_sdk()
        self.build: Any = None
        self.build_lnc: int | None = None
        self._target: NeuronTarget | None = None

    def bind_build(self, build) -> None:
        """The build: its `lnc` (second in the resolution order, after NEURON_LOGICAL_NC_CONFIG) and, for the NEFF
        cache key, the rest; the support check (`neuron-infer doctor`, backends/neuron/support.py) runs here, before
        anything is traced."""
        preflight(self.sdk, build)
        self.build, self.build_lnc, self._target = build, build.lnc, None

    def pin_target(self, target: NeuronTarget) -> None:
        """Use `target` (a compile worker receives the platform and LNC its parent resolved)."""
        self._target = target

    def target(self) -> NeuronTarget:
        """Resolved once per compile, so every graph of an artifact shares one platform and LNC."""
        if self._target is None:
            self._target = resolve_target(self.sdk, self.build_lnc)
        return self._target

    def compile_graph(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str) -> dict:
        """Trace one graph into out_dir through the NEFF cache (backends/neuron/cache.py): a cached graph is copied,
        a missing one traced and stored. Metadata: files, compile_s, platform, lnc and "cache" (hit | miss | off)."""
        target = self.target()
        key = neff_key(module, example_args, graph_name, target.record(), self.compiler_args(), self.build)
        return self.compile_keyed(module, example_args, out_dir, graph_name, key)

    def compiler_args(self) -> list[str]:
        return [*COMPILER_ARGS, *self.target().compiler_args()]

    def compile_keyed(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str,
                      key: str | None) -> dict:
        """compile_graph with its key already computed (None: not cacheable, traced and not stored)."""
        root = neff_cache_root()
        if key is None or root is None:
            return {**self.trace_into(module, example_args, out_dir, graph_name), "cache": "off"}
        return cached_compile(key, out_dir, lambda d: self.trace_into(module, example_args, d, graph_name), root)

    def trace_into(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str) -> dict:
        """torch_neuronx.trace one graph -> out_dir/<name>.pt and <name>.neuron.json. neuronx-cc works in a
        temporary directory outside the artifact, removed after a successful trace (kept after a failure)."""
        target = self.target()
        t0 = time.perf_counter()
        workdir = Path(tempfile.mkdtemp(prefix=f"neuron-infer-{graph_name}-"))
        with compile_env(target):
            traced = self.sdk.trace(FunctionalStep(module, target.lnc), example_args, compiler_workdir=str(workdir),
                                    compiler_args=self.compiler_args(), inline_weights_to_neff=False)
        shutil.rmtree(workdir, ignore_errors=True)
        torch.jit.save(traced, str(out_dir / f"{graph_name}.pt"))
        (out_dir / f"{graph_name}.neuron.json").write_text(json.dumps(target.record(), sort_keys=True))
        return {"files": [f"{graph_name}.pt", f"{graph_name}.neuron.json"],
                "compile_s": round(time.perf_counter() - t0, 3), **target.record()}

    def load_graph(self, out_dir: Path, graph_name: str, module: torch.nn.Module) -> Callable[..., torch.Tensor]:
        path = out_dir / f"{graph_name}.pt"
        check_runtime(read_target_record(out_dir / f"{graph_name}.neuron.json"), str(path))
        try:
            graph = torch.jit.load(str(path))
        except (RuntimeError, OSError) as e:
            raise ArtifactError(f"cannot load Neuron graph {path} ({e}); recompile the model") from e
        weights = {f"step.{k}": v for k, v in module.state_dict().items()}  # FunctionalStep prefixes "step."
        self.sdk.replace_weights(graph, weights)
        self.sdk.move_trace_to_device(graph, DEVICE_ID)  # else the weights cross from host on every call
        return copy_back(graph)


def read_target_record(path: Path) -> dict:
    """A graph's {platform, lnc} record written at compile time."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read {path} ({e}); recompile the model") from e


def copy_back(graph: Callable) -> Callable[..., torch.Tensor]:
    """Wrap a functional graph (caches in, (logits, k, v) out) as an in-place step: the updated caches are copied
    back into the engine's cache tensors and the logits returned (shared by the single-core and the TP backend)."""

    def run(input_ids, positions, k_cache, v_cache, logit_index, *tables):
        logits, k, v = graph(input_ids, positions, k_cache, v_cache, logit_index, *tables)
        k_cache.copy_(k)
        v_cache.copy_(v)
        return logits

    return run
