"""Recording test doubles of the Neuron SDK (it cannot be installed here): torch-neuronx and `nki`.

Every call is bound against the SDK's real signature first (tests/compile/neuron_sdk_signatures.py, each entry
naming its public source): an unknown keyword or a missing required argument fails the test.

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
import os
import types
from dataclasses import dataclass

import torch

from nki_kernels.sim import simulate_kernel
from tests.compile.neuron_sdk_signatures import checked


class RecordingNeuronSDK(types.ModuleType):
    """Stands in for `import torch_neuronx` (trace / replace_weights / move_trace_to_device /
    utils.get_platform_target). Every call is first bound against the real signature
    (tests/compile/neuron_sdk_signatures.py), so an argument the SDK does not take fails the test."""

    def __init__(self, platform: str = "trn2"):
        super().__init__("torch_neuronx")
        self.calls: list[tuple[str, dict]] = []
        self.platform = platform
        self.trace = checked("torch_neuronx.trace", self._trace)
        self.replace_weights = checked("torch_neuronx.replace_weights", self._replace_weights)
        self.move_trace_to_device = checked("torch_neuronx.move_trace_to_device", self._move)
        self.utils = types.SimpleNamespace(
            get_platform_target=checked("torch_neuronx.utils.get_platform_target", lambda: self.platform))

    def _trace(self, func, example_inputs, input_output_aliases, compiler_workdir, compiler_args,
               partitioner_config, inline_weights_to_neff, cpu_backend):
        self.calls.append(("trace", {"workdir": compiler_workdir, "args": compiler_args,
                                     "inline_weights_to_neff": inline_weights_to_neff,
                                     "platform_env": os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"),
                                     "shapes": [tuple(t.shape) for t in example_inputs]}))
        graph = torch.jit.trace(func, example_inputs, check_trace=False)
        with torch.no_grad():  # a NEFF compiled without inlined weights holds none: poison them
            for p in graph.parameters():
                p.fill_(float("nan"))
        return graph

    def _replace_weights(self, neuron_model, weights):
        self.calls.append(("replace_weights", {"keys": sorted(weights), "graph": id(neuron_model)}))
        params = dict(neuron_model.named_parameters())  # constants (rope tables, head maps) stay in the graph
        missing = set(params) - set(weights)
        assert not missing, f"weights missing for {sorted(missing)[:5]}"
        with torch.no_grad():
            for name, t in params.items():
                t.copy_(weights[name])

    def _move(self, trace, device_id):
        assert isinstance(device_id, int) and device_id >= 0, f"device_id must be a NeuronCore index, got {device_id!r}"
        self.calls.append(("move_trace_to_device", {"graph": id(trace), "device_id": device_id}))


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
        self.jit = checked("nki.jit", self._jit)

    def _jit(self, fn=None, **kwargs):
        assert callable(fn) and not hasattr(fn, "__wrapped__"), "jit must receive the plain kernel function"
        self.wrapped.append(fn.__name__)
        return _Jitted(self, fn)
