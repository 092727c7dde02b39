"""Recording test double of neuronx-distributed's ModelBuilder flow (the SDK cannot be installed here).

Every call is bound against the real signature (tests/compile/neuron_sdk_signatures.py, each entry naming its
public source). The double keeps the real flow's contract and runs the ranks for real, as threads of this process:

* `ModelBuilder.add(key, model_instance, example_inputs, compiler_args)`: example_inputs is a list of tensor tuples
  (one per bucket), compiler_args a string (model_builder.py append_default_compiler_flags takes a str).
* `trace()` builds each key's module ONCE, as rank 0 (SPMD: one graph serves every rank), takes the aliases from
  `model_instance.get(bucket_rank)`, and checks what NxDModel requires: every key's weights (state_dict minus the
  aliased state) have the same names, shapes and dtypes (spmd.py: "multiple SPMD bucket models that share the same
  weights"), aliases name parameters of the module, and no two buckets share input shapes (calls are routed by
  shape). Nothing is inlined: the module's weights are poisoned with NaN.
* `nxd_model.initialize(checkpoint, start_rank_tensor)`: one dict per rank, exactly the traced weight names and
  shapes; the aliased state is allocated per rank (zeros, as StateInitializer) and shared by every bucket.
* a call routes by input shapes, runs every rank's module in its own thread (NxD's mappings are thread-barrier
  collectives), writes each aliased output back into the rank's state and returns the other outputs
  (generate_hlo(..., output_aliased_tensor=False)).
`torch.jit.save`/`torch.jit.load` of the traced executor are patched by `install` to a registry.
"""
from __future__ import annotations

import copy
import itertools
import json
import sys
import threading
import types
from pathlib import Path

import torch

from tests.compile.neuron_doubles import RecordingNeuronSDK
from tests.compile.neuron_sdk_signatures import bind, checked

_REGISTRY: dict[str, object] = {}
_IDS = itertools.count()
MB = "neuronx_distributed.trace.model_builder"


class ThreadGroup:
    """Collectives among `tp` threads of this process (rank = thread-local)."""

    def __init__(self, tp: int):
        self.tp, self.barrier, self.slots, self.local = tp, threading.Barrier(tp), [None] * tp, threading.local()

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = t
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, input_, process_group=None) -> torch.Tensor:
        parts = self._exchange(input_)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p  # rank order: every rank computes the identical sum
        return out

    def all_gather_last(self, input_, process_group=None) -> torch.Tensor:
        return torch.cat(self._exchange(input_), dim=-1)


class BaseModelInstance:
    """As model_builder.BaseModelInstance: module_cls() is called by load_module; get returns (module, aliases)."""

    def __init__(self, *args, **kwargs):
        v = bind(f"{MB}.BaseModelInstance", None, *args, **kwargs)
        self.module_cls, self.module = v["module_cls"], None
        self.input_output_aliases = [v["input_output_aliases"]]

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


def _shapes(inputs) -> str:
    return str([tuple(t.shape) for t in inputs])


class Container:
    """One traced key: its module (rank 0's build), aliases by parameter name, example inputs."""

    def __init__(self, key, module, aliases: dict[str, int], example_inputs):
        self.key, self.module, self.aliases, self.example_inputs = key, module, aliases, example_inputs
        state = module.state_dict(keep_vars=True)
        self.weights = {k: (tuple(t.shape), t.dtype) for k, t in state.items() if k not in aliases}
        self.states = {k: (tuple(state[k].shape), state[k].dtype) for k in aliases}


def _alias_names(module, aliases: dict) -> dict[str, int]:
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    assert aliases, "no input_output_aliases: the state would be returned to the host every call"
    names = {}
    for p, idx in aliases.items():
        assert id(p) in by_id, "input_output_aliases keys must be parameters of the module get() returned"
        assert isinstance(idx, int) and idx >= 0, f"alias output index {idx!r}"
        names[by_id[id(p)]] = idx
    return names


class ModelBuilder:
    def __init__(self, owner: RecordingNxD, *args, **kwargs):
        self.owner, self.config = owner, bind(f"{MB}.ModelBuilder", None, *args, **kwargs)
        self.model_collection: dict[str, tuple] = {}
        owner.calls.append(("ModelBuilder", {k: v for k, v in self.config.items() if k != "self"}))

    def add(self, *args, **kwargs):
        v = bind(f"{MB}.ModelBuilder.add", self, *args, **kwargs)
        assert isinstance(v["example_inputs"], list) and all(
            isinstance(b, tuple) and all(isinstance(t, torch.Tensor) for t in b) for b in v["example_inputs"]), \
            "example_inputs is a list (one entry per bucket) of tensor tuples"
        assert v["compiler_args"] is None or isinstance(v["compiler_args"], str), "compiler_args is a str"
        self.model_collection[v["key"]] = (v["model_instance"], v["example_inputs"], v["compiler_args"])
        self.owner.calls.append(("ModelBuilder.add", {"key": v["key"], "compiler_args": v["compiler_args"],
                                                      "shapes": [[tuple(t.shape) for t in b] for b in v["example_inputs"]]}))
        return self

    def trace(self, *args, **kwargs):
        v = bind(f"{MB}.ModelBuilder.trace", self, *args, **kwargs)
        self.owner.group.local.rank = 0  # ModelBuilder traces under a mocked rank 0
        containers = []
        for key, (instance, examples, _) in self.model_collection.items():
            instance.load_module()
            for bucket, inputs in enumerate(examples):
                module, aliases = instance.get(bucket)
                containers.append(Container(key, module, _alias_names(module, aliases), inputs))
        first = containers[0]
        for c in containers[1:]:
            assert c.weights == first.weights, f"{c.key}: weights differ from {first.key}'s (one shared set)"
            assert c.states == first.states, f"{c.key}: aliased state differs from {first.key}'s"
        routes = [_shapes(c.example_inputs) for c in containers]
        assert len(set(routes)) == len(routes), f"buckets share input shapes; NxD cannot route them: {routes}"
        with torch.no_grad():  # weights are not inlined: the traced modules hold none
            for c in containers:
                for k, t in c.module.state_dict(keep_vars=True).items():
                    if t.is_floating_point() and k not in c.aliases:
                        t.fill_(float("nan"))
        self.owner.calls.append(("ModelBuilder.trace", dict(v, keys=[c.key for c in containers],
                                                             weights=sorted(first.weights),
                                                             aliases=dict(first.aliases))))
        return Executor(NxDModel(self.owner, containers, self.config["tp_degree"]))


class NxDModel:
    def __init__(self, owner, containers: list[Container], tp: int):
        self.owner, self.containers, self.tp = owner, containers, tp
        self.ranks: list[dict[str, torch.nn.Module]] | None = None
        self.initialize = checked("neuronx_distributed.trace.spmd.NxDModel.initialize", self._initialize,
                                  method=True)

    def _initialize(self, checkpoint, start_rank_tensor):
        assert isinstance(start_rank_tensor, torch.Tensor) and start_rank_tensor.dtype == torch.int32 \
            and tuple(start_rank_tensor.shape) == (1,), "start_rank_tensor is an int32 tensor [1]"
        assert isinstance(checkpoint, list) and len(checkpoint) == self.tp, "one weight dict per local rank"
        want = self.containers[0].weights
        self.ranks = []
        for r, weights in enumerate(checkpoint):
            got = {k: (tuple(t.shape), t.dtype) for k, t in weights.items()}
            assert got == want, f"rank {r}: weights {sorted(set(got) ^ set(want))[:4]} or shapes differ"
            states = {k: torch.zeros(s, dtype=d) for k, (s, d) in self.containers[0].states.items()}
            self.ranks.append({})
            for c in self.containers:  # every bucket binds the same weight and state tensors
                m = copy.deepcopy(c.module)
                m.load_state_dict({**weights, **states}, strict=True, assign=True)
                self.ranks[r][_shapes(c.example_inputs)] = (m, c)
        self.owner.calls.append(("NxDModel.initialize", {"ranks": len(checkpoint),
                                                         "start_rank": int(start_rank_tensor[0])}))

    def forward(self, inputs: list[torch.Tensor]):
        assert self.ranks is not None, "nxd_model.initialize was not called before the first call"
        key = _shapes(inputs)
        if key not in self.ranks[0]:
            raise ValueError(f"Input shape {key} not found in input_shape_map")
        outs, errors, group = [None] * self.tp, [], self.owner.group

        def run(r):
            group.local.rank = r
            module, c = self.ranks[r][key]
            try:
                with torch.no_grad():
                    result = list(module(*inputs))
                    state = dict(module.named_parameters(remove_duplicate=False))
                    for name, idx in c.aliases.items():  # device state updated in place
                        assert result[idx].shape == state[name].shape and result[idx].dtype == state[name].dtype
                        state[name].copy_(result[idx])
                outs[r] = [t for i, t in enumerate(result) if i not in set(c.aliases.values())]
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.owner.calls.append(("NxDModel.forward", {"route": key}))
        return outs[0]  # rank 0's non-aliased outputs


class Executor:
    def __init__(self, nxd_model: NxDModel):
        self.nxd_model = nxd_model

    def __call__(self, *inputs):
        return self.nxd_model.forward(list(inputs))


class RecordingNxD(types.ModuleType):
    def __init__(self, tp: int):
        super().__init__("neuronx_distributed")
        self.calls: list[tuple[str, dict]] = []
        self.group = g = ThreadGroup(tp)
        ps = "neuronx_distributed.parallel_layers"
        self.parallel_layers = types.SimpleNamespace(
            parallel_state=types.SimpleNamespace(get_tensor_model_parallel_rank=checked(
                f"{ps}.parallel_state.get_tensor_model_parallel_rank", lambda: g.local.rank)),
            mappings=types.SimpleNamespace(
                reduce_from_tensor_model_parallel_region=checked(
                    f"{ps}.mappings.reduce_from_tensor_model_parallel_region", g.all_reduce),
                gather_from_tensor_model_parallel_region=checked(
                    f"{ps}.mappings.gather_from_tensor_model_parallel_region", g.all_gather_last)),
        )
        owner = self
        self.model_builder = types.ModuleType(MB)
        self.model_builder.BaseModelInstance = BaseModelInstance
        self.model_builder.ModelBuilder = lambda *a, **k: ModelBuilder(owner, *a, **k)
        self.trace = types.ModuleType("neuronx_distributed.trace")
        self.trace.model_builder = self.model_builder


def install(monkeypatch, tp: int, platform: str = "trn2") -> tuple[RecordingNxD, RecordingNeuronSDK]:
    """Put both doubles in sys.modules and route torch.jit.save/load of the traced executor to a registry."""
    nxd, sdk = RecordingNxD(tp), RecordingNeuronSDK(platform)
    monkeypatch.setitem(sys.modules, "neuronx_distributed", nxd)
    monkeypatch.setitem(sys.modules, "neuronx_distributed.trace", nxd.trace)
    monkeypatch.setitem(sys.modules, MB, nxd.model_builder)
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    save, load = torch.jit.save, torch.jit.load

    def fake_save(m, f, *a, **k):
        if not isinstance(m, Executor):
            return save(m, f, *a, **k)
        key = f"model-{next(_IDS)}"
        _REGISTRY[key] = m
        Path(f).write_text(json.dumps({"nxd_double": key}))
        return None

    def fake_load(f, *a, **k):
        try:
            key = json.loads(Path(f).read_text())["nxd_double"]
        except (ValueError, KeyError, UnicodeDecodeError, TypeError):
            return load(f, *a, **k)
        return _REGISTRY[key]

    monkeypatch.setattr(torch.jit, "save", fake_save)
    monkeypatch.setattr(torch.jit, "load", fake_load)
    return nxd, sdk
