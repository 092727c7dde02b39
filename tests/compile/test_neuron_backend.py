"""The Neuron backend through a recording test double of torch-neuronx (the SDK cannot be installed here).

The double (tests/compile/neuron_doubles.py) records every SDK call and implements `trace` with `torch.jit.trace`
and `replace_weights` by loading the given tensors into the graph, so compile -> save -> load -> generate runs end
to end and a wrong weight mapping or a broken cache write-back changes the tokens.
"""
import sys
import types

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.compile.builder import compile_model
from neuron_infer.compile.neuron import import_sdk
from neuron_infer.config import BuildConfig
from neuron_infer.errors import BackendUnavailableError
from tests.compile.neuron_doubles import RecordingNeuronSDK

BUILD = BuildConfig(target="neuron", dtype="fp32", max_context_length=32, max_length=64,
                    context_buckets=(16, 32), tokengen_buckets=(64,))


@pytest.fixture
def sdk(monkeypatch):
    fake = RecordingNeuronSDK()
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    return fake


def test_without_the_sdk_one_sentence_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import fails
    with pytest.raises(BackendUnavailableError, match="Neuron pip repository"):
        import_sdk()


def test_a_placeholder_package_is_detected(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    with pytest.raises(BackendUnavailableError, match="placeholder"):
        import_sdk()


def test_compile_traces_one_graph_per_bucket_without_inlined_weights(sdk, tiny_dirs, tmp_path):
    manifest = compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, say=lambda m: None)
    traces = [c for name, c in sdk.calls if name == "trace"]
    assert sorted(manifest.graphs) == ["context_t16_s16", "context_t32_s32", "tokengen_t1_s64"]
    assert len(traces) == 3 and all(t["inline_weights_to_neff"] is False for t in traces)
    assert sorted(t["shapes"][0] for t in traces) == [(1, 1), (1, 16), (1, 32)]  # input_ids [B, T] per bucket
    assert all((tmp_path / "a" / "graphs" / f"{g}.pt").is_file() for g in manifest.graphs)
    assert manifest.backend == "neuron"


def test_generate_through_the_double_equals_the_cpu_reference(sdk, tiny_dirs, tmp_path):
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "neuron", BUILD, say=lambda m: None)
    compile_model(d, tmp_path / "eager", BUILD.replace(target="cpu"), backend="cpu-eager", say=lambda m: None)
    prompt = [list(range(5, 25))]
    got = CompiledModel.load(tmp_path / "neuron").generate_ids(prompt, 40, ignore_eos=True)
    ref = CompiledModel.load(tmp_path / "eager").generate_ids(prompt, 40, ignore_eos=True)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    loads = [c for name, c in sdk.calls if name == "replace_weights"]
    assert len(loads) == 3 and "step.model.model.embed_tokens.weight" in loads[0]["keys"]
