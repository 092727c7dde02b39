"""The Neuron backend through a recording test double of torch-neuronx (the SDK cannot be installed here).

The double (tests/compile/neuron_doubles.py) binds every call against the real signatures
(tests/compile/neuron_sdk_signatures.py), records it and implements `trace` with `torch.jit.trace` and
`replace_weights` by loading the given tensors into the graph, so compile -> save -> load -> generate runs end to
end and a wrong weight mapping or a broken cache write-back changes the tokens. Not yet run on hardware.
"""
import json
import sys
import types

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.backends.neuron.graph import import_sdk
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig
from neuron_infer.errors import ArtifactError, BackendUnavailableError, ConfigError
from tests.compile.neuron_doubles import RecordingNeuronSDK
from tests.compile.neuron_sdk_signatures import SDKContractError

BUILD = BuildConfig(target="neuron", dtype="fp32", max_context_length=32, max_length=64,
                    context_buckets=(16, 32), tokengen_buckets=(64,))


@pytest.fixture(autouse=True)
def neuron_env(monkeypatch):
    """Both variables unset for the test and restored after it (loading sets NEURON_LOGICAL_NC_CONFIG)."""
    for name in (LNC_ENV, PLATFORM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def sdk(monkeypatch):
    fake = RecordingNeuronSDK()  # platform trn2
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
    assert sorted(manifest.graphs) == ["context_t16_s16", "context_t16_s32", "context_t32_s32", "tokengen_t1_s64"]
    assert len(traces) == 4 and all(t["inline_weights_to_neff"] is False for t in traces)
    assert sorted(t["shapes"][0] for t in traces) == [(1, 1), (1, 16), (1, 16), (1, 32)]  # input_ids [B, T]
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
    assert len(loads) == 4 and "step.model.model.embed_tokens.weight" in loads[0]["keys"]


def _compile_args(sdk):
    return [c["args"] for name, c in sdk.calls if name == "trace"]


def test_loading_moves_every_weight_separated_graph_to_the_device(sdk, tiny_dirs, tmp_path):
    """torch-neuronx docs: a trace with inline_weights_to_neff=False keeps its weights on the host until
    move_trace_to_device(trace, device_id) is called on the loaded module."""
    compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, say=lambda m: None)
    CompiledModel.load(tmp_path / "a")
    replaced = [c["graph"] for name, c in sdk.calls if name == "replace_weights"]
    moved = [c for name, c in sdk.calls if name == "move_trace_to_device"]
    assert len(replaced) == 4 and sorted(c["graph"] for c in moved) == sorted(replaced)
    assert {c["device_id"] for c in moved} == {0}


@pytest.mark.parametrize(("platform", "lnc"), [("trn2", 2), ("trn3", 2), ("trn1", 1), ("inf2", 1)])
def test_the_lnc_defaults_to_the_platform_and_is_recorded(monkeypatch, tiny_dirs, tmp_path, platform, lnc):
    sdk = RecordingNeuronSDK(platform)
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    manifest = compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, say=lambda m: None)
    assert all(args[-1] == f"--lnc={lnc}" for args in _compile_args(sdk))
    assert {(g["platform"], g["lnc"]) for g in manifest.graphs.values()} == {(platform, lnc)}
    assert manifest.neuron_lnc == lnc
    record = json.loads((tmp_path / "a" / "graphs" / "tokengen_t1_s64.neuron.json").read_text())
    assert record == {"platform": platform, "lnc": lnc}


def test_the_environment_wins_over_the_build_which_wins_over_the_platform(sdk, monkeypatch, tiny_dirs, tmp_path):
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "build", BUILD.replace(lnc=1), say=lambda m: None)
    assert {args[-1] for args in _compile_args(sdk)} == {"--lnc=1"}      # build over the trn2 default (2)
    sdk.calls.clear()
    monkeypatch.setenv(LNC_ENV, "2")
    with pytest.warns(UserWarning, match="overrides the build"):
        compile_model(d, tmp_path / "env", BUILD.replace(lnc=1), say=lambda m: None)
    assert {args[-1] for args in _compile_args(sdk)} == {"--lnc=2"}      # environment over the build


def test_an_lnc_the_platform_lacks_is_refused(monkeypatch, tiny_dirs, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_neuronx", RecordingNeuronSDK("trn1"))
    with pytest.raises(ConfigError, match="trn2/trn3 only"):
        compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD.replace(lnc=2), say=lambda m: None)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="1 or 2"):
        BUILD.replace(lnc=4)


def test_the_compile_targets_the_platform_for_the_nki_kernels(sdk, monkeypatch, tiny_dirs, tmp_path):
    """NEURON_PLATFORM_TARGET_OVERRIDE is set to the platform while tracing (our kernels branch on
    nisa.get_nc_version()), restored afterwards, and an explicit override wins over the detected platform."""
    compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, say=lambda m: None)
    assert {c["platform_env"] for name, c in sdk.calls if name == "trace"} == {"trn2"}
    import os

    assert not os.environ.get(PLATFORM_ENV)
    sdk.calls.clear()
    monkeypatch.setenv(PLATFORM_ENV, "gen4")                       # nki.jit's synonym of trn3
    m = compile_model(tiny_dirs("gqa"), tmp_path / "b", BUILD, say=lambda m: None)
    assert {g["platform"] for g in m.graphs.values()} == {"trn3"}
    assert {c["platform_env"] for name, c in sdk.calls if name == "trace"} == {"gen4"}


def test_a_runtime_lnc_other_than_the_compiled_one_is_refused(sdk, monkeypatch, tiny_dirs, tmp_path):
    import os

    compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, say=lambda m: None)   # trn2: LNC 2
    monkeypatch.setenv(LNC_ENV, "1")
    with pytest.raises(ArtifactError, match="compiled for LNC 2"):
        CompiledModel.load(tmp_path / "a")
    monkeypatch.delenv(LNC_ENV)
    CompiledModel.load(tmp_path / "a")
    assert os.environ[LNC_ENV] == "2"                               # the runtime starts with the compiled LNC


def test_the_double_rejects_calls_the_real_sdk_would_reject(sdk):
    with pytest.raises(SDKContractError, match="unexpected keyword"):
        sdk.trace(lambda x: x, (), inline_weights=False)
    with pytest.raises(SDKContractError, match="device_id"):
        sdk.move_trace_to_device(object())
