"""Recording test doubles of the Neuron SDK (it cannot be installed here): torch-neuronx and `nki`.

`RecordingNeuronSDK` (torch_neuronx) records every SDK call and implements `trace` with `torch.jit.trace` (a real
TorchScript graph of the functional step, its parameters poisoned with NaN as a NEFF compiled without inlined
weights holds none) and `replace_weights` by loading the given tensors into the graph, so compile -> save -> load
-> generate runs end to end and a wrong weight mapping or a broken cache write-back changes the tokens.

`RecordingNKI.jit(fn)` records the wrap; `jitted[grid](*args)` records the launch (kernel name, grid, tensor
shapes/dtypes, static arguments) and emits one opaque custom op, `nki_double::launch`, into whatever is being
traced, as the SDK emits an XLA custom call (`AwsNeuronCustomNativeKernel`). The op's implementation runs the kernel
on our NumPy simulator, so a graph traced with `torch.jit.trace` (the torch-neuronx double) re-runs the real kernels
on every call and a wrong layout, head map or dtype changes the logits. The double refuses anything the SDK's jit
would not receive from a traced graph: NumPy arrays, a missing grid, a grid other than 1 or 2.
"""
from __future__ import annotations

import json
import types
from dataclasses import dataclass

import torch

from nki_kernels.sim import simulate_kernel


class RecordingNeuronSDK(types.ModuleType):
    """Stands in for `import torch_neuronx` (trace / replace_weights)."""

    def __init__(self):
        super().__init__("torch_neuronx")
        self.calls: list[tuple[str, dict]] = []

    def trace(self, func, example_inputs, compiler_workdir=None, compiler_args=None, inline_weights_to_neff=True):
        self.calls.append(("trace", {"workdir": compiler_workdir, "args": compiler_args,
                                     "inline_weights_to_neff": inline_weights_to_neff,
                                     "shapes": [tuple(t.shape) for t in example_inputs]}))
        graph = torch.jit.trace(func, example_inputs, check_trace=False)
        with torch.no_grad():  # a NEFF compiled without inlined weights holds none: poison them
            for p in graph.parameters():
                p.fill_(float("nan"))
        return graph

    def replace_weights(self, graph, weights):
        self.calls.append(("replace_weights", {"keys": sorted(weights)}))
        params = dict(graph.named_parameters())  # constants (rope tables, head maps) stay in the graph
        missing = set(params) - set(weights)
        assert not missing, f"weights missing for {sorted(missing)[:5]}"
        with torch.no_grad():
            for name, t in params.items():
                t.copy_(weights[name])


_KERNELS: dict[str, object] = {}   # key -> undecorated kernel function (the custom op looks kernels up here)
RUNS: list[str] = []               # keys of kernels executed by the custom op (trace time and run time)


@torch.library.custom_op("nki_double::launch", mutates_args=())
def _launch_op(key: str, grid: int, tensors: list[torch.Tensor], statics: str) -> torch.Tensor:
    """Run kernel `key` on the simulator: `statics` lists the argument slots (tensor index or static value)."""
    slots = json.loads(statics)
    args = [tensors[v] if kind == "t" else (tuple(v) if isinstance(v, list) else v) for kind, v in slots]
    RUNS.append(key)
    out = simulate_kernel(_KERNELS[key], tuple(args), {}, lnc=grid)
    return out.clone()


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: int
    shapes: tuple
    dtypes: tuple
    statics: tuple


class _Jitted:
    def __init__(self, owner: RecordingNKI, fn):
        self.owner, self.fn = owner, fn
        self.key = f"{fn.__module__}.{fn.__qualname__}"
        _KERNELS[self.key] = fn

    def __call__(self, *args):
        raise AssertionError(f"{self.key} launched without a grid; the neuron path must use jitted[lnc](...)")

    def __getitem__(self, grid):
        assert grid in (1, 2), f"grid must be the LNC degree 1 or 2, got {grid!r}"
        return lambda *args: self._launch(grid, args)

    def _launch(self, grid: int, args: tuple) -> torch.Tensor:
        tensors, slots = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                slots.append(("t", len(tensors)))
                tensors.append(a)
            else:
                assert isinstance(a, (int, float, tuple)), f"{self.key}: non-tensor argument {type(a).__name__}"
                slots.append(("s", a))
        self.owner.launches.append(Launch(self.fn.__name__, grid, tuple(tuple(map(int, t.shape)) for t in tensors),
                                          tuple(t.dtype for t in tensors), tuple(v for k, v in slots if k == "s")))
        return torch.ops.nki_double.launch(self.key, grid, tensors, json.dumps(slots))


class RecordingNKI(types.ModuleType):
    """Stands in for `import nki` of the Neuron SDK (only `jit` is used by model/nki_neuron.py)."""

    def __init__(self):
        super().__init__("nki")
        self.wrapped: list[str] = []
        self.launches: list[Launch] = []

    def jit(self, fn=None, **kwargs):
        assert callable(fn) and not hasattr(fn, "__wrapped__"), "jit must receive the plain kernel function"
        self.wrapped.append(fn.__name__)
        return _Jitted(self, fn)
