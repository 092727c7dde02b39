"""Neuron tensor parallelism through a recording test double of neuronx-distributed's ModelBuilder.

The double (tests/parallel/nxd_double.py) binds every call against the real signatures, traces each graph's
module once (SPMD), loads one weight set per rank with `nxd_model.initialize`, keeps the aliased KV caches as
per-rank device state and runs the ranks as threads with NxD's mappings as thread-barrier collectives. So a wrong
rank weight, a rank constant baked into the graph, a lost cache alias or an ambiguous bucket route changes the
generated tokens, which must equal the tp = 1 CPU reference. Not yet run on hardware.
"""
from __future__ import annotations

import sys

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.backends.neuron.graph import COMPILER_ARGS
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.compile.builder import compile_model
from neuron_infer.errors import BackendUnavailableError
from tests.parallel.nxd_double import install
from tests.parallel.test_tp_e2e import BUILD
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

IDS = [[1, 17, 42, 99, 7]]


@pytest.fixture(autouse=True)
def neuron_env(monkeypatch):
    """Both variables unset for the test and restored after it (loading sets NEURON_LOGICAL_NC_CONFIG)."""
    for name in (LNC_ENV, PLATFORM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ntp") / "gqa", **TINY_PRESETS["gqa"])


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ntp_ref") / "ref"
    compile_model(ckpt, out, BUILD, backend="cpu-eager", say=lambda m: None)
    return CompiledModel.load(out).generate_ids(IDS, 12, ignore_eos=True).outputs[0].token_ids


def test_without_neuronx_distributed_the_compile_fails_before_any_work(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)
    with pytest.raises(BackendUnavailableError, match="neuronx-distributed"):
        compile_model(ckpt, tmp_path / "a", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("tp", [2, 4])
def test_neuron_tp_through_the_double_equals_the_cpu_reference(ckpt, tmp_path, monkeypatch, tp, reference):
    nxd, _ = install(monkeypatch, tp)
    m = compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=tp), say=lambda m: None)
    assert m.backend == "neuron" and "not yet run on hardware" in m.extra.tp_backend_note
    got = CompiledModel.load(tmp_path / "n").generate_ids(IDS, 12, ignore_eos=True).outputs[0].token_ids
    assert got == reference
    routes = {c["route"] for name, c in nxd.calls if name == "NxDModel.forward"}
    assert len(routes) >= 2                                   # prefill and decode buckets both ran


def test_one_model_builder_shares_one_weight_set_across_every_bucket(ckpt, tmp_path, monkeypatch):
    """ModelBuilder gets every planned graph as a key of ONE builder (one NxD model, loaded once), weights are
    never inlined, and loading passes one weight dict per rank to nxd_model.initialize, once."""
    nxd, _ = install(monkeypatch, 2)
    m = compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    names = [name for name, _ in nxd.calls]
    assert names.count("ModelBuilder") == 1 and names.count("ModelBuilder.trace") == 1
    (builder,) = [c for name, c in nxd.calls if name == "ModelBuilder"]
    assert builder["tp_degree"] == 2 and builder["router"] is None
    (trace,) = [c for name, c in nxd.calls if name == "ModelBuilder.trace"]
    assert trace["initialize_model_weights"] is False and sorted(trace["keys"]) == sorted(m.graphs) and \
        len(m.graphs) == 5                                    # 2 context + 1 after a cached prefix + 2 decode
    assert "step.model.model.embed_tokens.start" in trace["weights"]   # the rank's vocab start is a weight
    assert {g["files"][0] for g in m.graphs.values()} == {"nxd_model.pt"}
    CompiledModel.load(tmp_path / "n")
    inits = [c for name, c in nxd.calls if name == "NxDModel.initialize"]
    assert inits == [{"ranks": 2, "start_rank": 0}]


def test_the_kv_cache_is_aliased_device_state_not_an_input_or_output(ckpt, tmp_path, monkeypatch, reference):
    nxd, _ = install(monkeypatch, 2)
    compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    (trace,) = [c for name, c in nxd.calls if name == "ModelBuilder.trace"]
    assert trace["aliases"] == {"k_cache": 1, "v_cache": 2}
    assert not any(w.endswith("_cache") for w in trace["weights"])
    adds = [c for name, c in nxd.calls if name == "ModelBuilder.add"]
    cache_elems = 2 * BUILD.max_length                     # any input as large as a cache row set would show here
    for add in adds:                                       # inputs: ids, positions, logit index, attend rows, table
        (shapes,) = add["shapes"]
        assert len(shapes) == 5 and all(len(s) <= 2 for s in shapes)
        assert max(x for s in shapes for x in s) < cache_elems
    model = CompiledModel.load(tmp_path / "n")
    assert model.engine.k_cache.numel() == 0                # the host holds no cache
    assert model.generate_ids(IDS, 12, ignore_eos=True).outputs[0].token_ids == reference


@pytest.mark.parametrize(("platform", "lnc"), [("trn2", 2), ("inf2", 1)])
def test_lnc_and_platform_reach_model_builder_the_compiler_and_the_manifest(ckpt, tmp_path, monkeypatch, platform,
                                                                           lnc):
    nxd, _ = install(monkeypatch, 2, platform)
    m = compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    (builder,) = [c for name, c in nxd.calls if name == "ModelBuilder"]
    assert builder["logical_nc_config"] == lnc
    adds = [c for name, c in nxd.calls if name == "ModelBuilder.add"]
    assert all(a["compiler_args"] == " ".join([*COMPILER_ARGS, f"--lnc={lnc}"]) for a in adds)
    assert m.neuron_lnc == lnc and {g["platform"] for g in m.graphs.values()} == {platform}


def test_a_runtime_lnc_other_than_the_compiled_one_is_refused(ckpt, tmp_path, monkeypatch):
    from neuron_infer.errors import ArtifactError

    nxd, _ = install(monkeypatch, 2)                       # trn2: compiled for LNC 2
    compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=2), say=lambda m: None)
    monkeypatch.setenv(LNC_ENV, "1")
    with pytest.raises(ArtifactError, match="compiled for LNC 2"):
        CompiledModel.load(tmp_path / "n")
    assert not any(name == "NxDModel.initialize" for name, _ in nxd.calls)   # refused before touching the device
