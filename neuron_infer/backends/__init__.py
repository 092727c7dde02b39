"""Graph backends: compile one step module into a graph; load it back. The one interface compile/ and runtime/ use.

    compile_graph(module, example_args, out_dir, graph_name) -> dict   (metadata for the manifest)
    load_graph(out_dir, graph_name, module) -> callable(*example_args-like) -> logits

    backends/cpu/      torch.export + AOTInductor, dynamic shapes; the C++ kernels and their custom ops
    backends/neuron/   torch_neuronx.trace per static bucket; neuronx-distributed for tensor parallelism
    backends/graph_cache.py   the content-addressed compile cache both use

`module` at load time holds the (already loaded) weights, so every graph shares one weight file.
Backends are imported lazily by name: importing neuron_infer never imports the Neuron SDK.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from neuron_infer.errors import ConfigError

if TYPE_CHECKING:
    import torch


class Backend(Protocol):
    name: str

    def compile_graph(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str) -> dict:
        ...

    def load_graph(self, out_dir: Path, graph_name: str, module: torch.nn.Module) -> Callable[..., Any]:
        ...


class EagerBackend:
    """Runs the module eagerly (no compiled graph). For debugging and fast functional tests only."""

    name = "cpu-eager"

    def compile_graph(self, module, example_args, out_dir, graph_name) -> dict:
        return {"files": []}

    def load_graph(self, out_dir, graph_name, module):
        return module


_REGISTRY: dict[str, str] = {
    "cpu": "neuron_infer.backends.cpu.graph:CpuBackend",
    "cpu-eager": "neuron_infer.backends:EagerBackend",
    "neuron": "neuron_infer.backends.neuron.graph:NeuronBackend",
}


def get_backend(name: str) -> Backend:
    """Instantiate the backend registered under `name` (imported only now)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown backend {name!r}; choose one of {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()
