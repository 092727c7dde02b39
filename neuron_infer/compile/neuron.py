"""Neuron backend: one NEFF per (sub-model, bucket) through torch-neuronx. NOT YET RUN ON HARDWARE.

Written against the documented torch-neuronx API and exercised in CI through a recording test double
(tests/compile/test_neuron_backend.py). The SDK is imported lazily, only when this backend is used.

    compile: torch_neuronx.trace(step, example_args, compiler_workdir=..., compiler_args=[...],
                                 inline_weights_to_neff=False)   -> torch.jit.save(graphs/<name>.pt)
    load:    torch.jit.load(graphs/<name>.pt); torch_neuronx.replace_weights(graph, weights)

With `--kernels nki` the step is traced under `nki_neuron.neuron_target()`, so the NKI kernels are launched through
the SDK's `nki.jit` as custom calls inside the graph (model/nki_neuron.py).

Weights stay outside the NEFFs (`inline_weights_to_neff=False`) so every bucket graph shares the one per-rank
weight file of the artifact, as on CPU. Traced graphs cannot mutate their inputs, so the step is traced in
functional form (caches in, updated caches out) and the loaded callable copies the result back into the engine's
cache tensors. On a device this copy is avoidable with input/output aliasing (neuronx-distributed ModelBuilder);
that is the next step once this runs on hardware.
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neuron_infer.errors import ArtifactError, BackendUnavailableError
from neuron_infer.model.nki_neuron import compiler_lnc_args, neuron_target

INSTALL_HINT = (
    "the neuron target needs the AWS Neuron SDK (torch-neuronx and neuronx-cc) installed from the Neuron pip "
    "repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx neuronx-cc) on a "
    "Trn1/Inf2/Trn2/Trn3 instance; the PyPI packages of those names are empty placeholders. Use --target cpu here."
)
COMPILER_ARGS = ("--model-type=transformer", "--auto-cast=none", "-O1")


def import_sdk() -> Any:
    """Return the torch_neuronx module, or raise one clear sentence when it is absent or a placeholder."""
    try:
        sdk = importlib.import_module("torch_neuronx")
    except ImportError as e:
        raise BackendUnavailableError(INSTALL_HINT) from e
    if not (callable(getattr(sdk, "trace", None)) and callable(getattr(sdk, "replace_weights", None))):
        raise BackendUnavailableError("the installed torch_neuronx is a placeholder without trace(); " + INSTALL_HINT)
    return sdk


class FunctionalStep(torch.nn.Module):
    """A bucket step whose cache updates are returned instead of applied in place (traceable by torch-neuronx)."""

    def __init__(self, step: torch.nn.Module):
        super().__init__()
        self.step = step

    def forward(self, input_ids, positions, k_cache, v_cache, logit_index, *seq_ids):
        k, v = k_cache.clone(), v_cache.clone()  # [L, R, Hkv, S, D] each
        with neuron_target():  # kernels="nki": launch the kernels through the SDK's nki.jit (model/nki_neuron.py)
            logits = self.step(input_ids, positions, k, v, logit_index, *seq_ids)  # [B, n, V]
        return logits, k, v


class NeuronBackend:
    name = "neuron"

    def __init__(self, sdk: Any | None = None):
        self.sdk = sdk or import_sdk()

    def compile_graph(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str) -> dict:
        workdir = out_dir / f"{graph_name}.workdir"
        t0 = time.perf_counter()
        traced = self.sdk.trace(FunctionalStep(module), example_args, compiler_workdir=str(workdir),
                                compiler_args=[*COMPILER_ARGS, *compiler_lnc_args(module)],
                                inline_weights_to_neff=False)
        torch.jit.save(traced, str(out_dir / f"{graph_name}.pt"))
        return {"files": [f"{graph_name}.pt"], "compile_s": round(time.perf_counter() - t0, 3)}

    def load_graph(self, out_dir: Path, graph_name: str, module: torch.nn.Module) -> Callable[..., torch.Tensor]:
        path = out_dir / f"{graph_name}.pt"
        try:
            graph = torch.jit.load(str(path))
        except (RuntimeError, OSError) as e:
            raise ArtifactError(f"cannot load Neuron graph {path} ({e}); recompile the model") from e
        weights = {f"step.{k}": v for k, v in module.state_dict().items()}  # FunctionalStep prefixes "step."
        self.sdk.replace_weights(graph, weights)

        return copy_back(graph)


def copy_back(graph: Callable) -> Callable[..., torch.Tensor]:
    """Wrap a functional graph (caches in, (logits, k, v) out) as an in-place step: the updated caches are copied
    back into the engine's cache tensors and the logits returned (shared by the single-core and the TP backend)."""

    def run(input_ids, positions, k_cache, v_cache, logit_index, *seq_ids):
        logits, k, v = graph(input_ids, positions, k_cache, v_cache, logit_index, *seq_ids)
        k_cache.copy_(k)
        v_cache.copy_(v)
        return logits

    return run
