"""Neuron tensor parallelism through a recording test double of neuronx-distributed (the SDK cannot be installed).

The double records every call and runs the ranks for real, as threads of this process: `parallel_model_trace`
calls the factory once per rank (with that rank visible through `parallel_state`), the "traced" model runs every
rank's module in its own thread, and the NxD mappings are implemented as thread-barrier collectives (all-reduce in
rank order, last-dim all-gather). So a wrong rank file, a broken collective binding or a lost cache write-back
changes the generated tokens, which must equal the tp = 1 CPU reference.
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from neuron_infer.api import CompiledModel
from neuron_infer.compile.builder import compile_model
from neuron_infer.compile.neuron import COMPILER_ARGS
from neuron_infer.errors import BackendUnavailableError
from tests.parallel.test_tp_e2e import BUILD
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

_REGISTRY: dict[str, object] = {}
_IDS = itertools.count()


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

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p  # rank order: every rank computes the identical sum
        return out

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=-1)


class FakeTPModel:
    def __init__(self, modules: list, group: ThreadGroup):
        self.modules, self.group = modules, group

    def __call__(self, *args):
        outs, errors = [None] * len(self.modules), []

        def run(r):
            self.group.local.rank = r
            try:
                with torch.no_grad():
                    outs[r] = self.modules[r](*args)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.modules))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return outs[0]  # the TP model returns rank 0's outputs


class RecordingNxD(types.ModuleType):
    def __init__(self, tp: int):
        super().__init__("neuronx_distributed")
        self.calls: list[tuple[str, dict]] = []
        self.group = ThreadGroup(tp)
        g = self.group
        self.parallel_layers = types.SimpleNamespace(
            parallel_state=types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: g.local.rank),
            mappings=types.SimpleNamespace(reduce_from_tensor_model_parallel_region=g.all_reduce,
                                           gather_from_tensor_model_parallel_region=g.all_gather_last),
        )
        self.trace = types.SimpleNamespace(parallel_model_trace=self._trace, parallel_model_save=self._save,
                                           parallel_model_load=self._load)

    def _trace(self, func, example_inputs, compiler_workdir=None, compiler_args=None, inline_weights_to_neff=True,
               bucket_config=None, tp_degree=1, max_parallel_compilations=None):
        modules, ranks = [], []
        for r in range(tp_degree):
            self.group.local.rank = r
            module, _states = func()
            modules.append(module)
            ranks.append(module.rank)
        self.calls.append(("parallel_model_trace", {"tp_degree": tp_degree, "compiler_args": compiler_args,
                                                    "workdir": compiler_workdir, "ranks": ranks,
                                                    "shapes": [tuple(t.shape) for t in example_inputs]}))
        return FakeTPModel(modules, self.group)

    def _save(self, model, path):
        key = f"model-{next(_IDS)}"
        _REGISTRY[key] = model
        Path(path).mkdir(parents=True)
        (Path(path) / "double.json").write_text(json.dumps({"key": key}))
        self.calls.append(("parallel_model_save", {"path": path}))

    def _load(self, path):
        self.calls.append(("parallel_model_load", {"path": path}))
        return _REGISTRY[json.loads((Path(path) / "double.json").read_text())["key"]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ntp") / "gqa", **TINY_PRESETS["gqa"])


def test_without_neuronx_distributed_the_compile_fails_before_any_work(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)
    with pytest.raises(BackendUnavailableError, match="neuronx-distributed"):
        compile_model(ckpt, tmp_path / "a", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("tp", [2, 4])
def test_neuron_tp_through_the_double_equals_the_cpu_reference(ckpt, tmp_path, monkeypatch, tp):
    nxd = RecordingNxD(tp)
    monkeypatch.setitem(sys.modules, "neuronx_distributed", nxd)
    m = compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=tp), say=lambda m: None)
    assert m.backend == "neuron" and "not yet run on hardware" in m.extra["tp_backend_note"]
    traces = [c for name, c in nxd.calls if name == "parallel_model_trace"]
    assert len(traces) == len(m.graphs) == 4  # 2 context + 2 decode buckets
    local_kv = m.extra["tp_plan"]["ranks"][0]["kv_heads"]
    for t in traces:
        assert t["tp_degree"] == tp and t["compiler_args"] == list(COMPILER_ARGS) and t["ranks"] == list(range(tp))
        assert t["shapes"][2][:4] == (tp, 2, BUILD.batch_size if t["shapes"][0][1] == 1 else 1, len(local_kv))
    compile_model(ckpt, tmp_path / "ref", BUILD, backend="cpu-eager", say=lambda m: None)
    ids = [[1, 17, 42, 99, 7]]
    ref = CompiledModel.load(tmp_path / "ref").generate_ids(ids, 12, ignore_eos=True).outputs[0].token_ids
    got = CompiledModel.load(tmp_path / "n").generate_ids(ids, 12, ignore_eos=True).outputs[0].token_ids
    assert got == ref
    assert sum(name == "parallel_model_load" for name, _ in nxd.calls) == 4
