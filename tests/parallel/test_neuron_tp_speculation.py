"""Speculative decoding on Neuron at tp > 1 through the recording neuronx-distributed double (tests/parallel/
nxd_double.py: real signatures, one traced module per key, one weight set and one aliased state shared by every
key, ranks run as threads with barrier collectives). Not yet run on hardware.

Greedy tokens must equal the same checkpoint at tp = 1 on CPU (speculation is lossless), fused, unfused and with
prompt lookup; the speculative steps must really run on the device keys. The CS3 preset
(configs/cs3-llama3.1-405b-fp8-fused-spec-trn2.json: FP8, fused speculation with a draft, k = 7, tp 64, NKI kernels,
its buckets) compiles through the double with a tiny stand-in target and draft of the preset's head layout.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.artifact.plan import planned_graphs
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import SpeculationConfig
from neuron_infer.presets import load_preset
from tests.parallel.nxd_double import install
from tests.parallel.test_tp_e2e import BUILD
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

IDS = [[1, 17, 42, 99, 7, 17, 42, 99]]  # repeats itself: prompt lookup finds drafts
NEW = 12
SPECS = {
    "fused": SpeculationConfig("self", 3, fused=True, draft_quant="int8"),
    "unfused": SpeculationConfig("self", 3, fused=False, draft_layers=1),
    "ngram": SpeculationConfig("ngram", 3),
}


@pytest.fixture(autouse=True)
def neuron_env(monkeypatch):
    for name in (LNC_ENV, PLATFORM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ntps") / "gqa", **TINY_PRESETS["gqa"])


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ntps_ref") / "ref"
    compile_model(ckpt, out, BUILD, backend="cpu-eager", say=lambda m: None)
    return CompiledModel.load(out).generate_ids(IDS, NEW, ignore_eos=True).outputs[0].token_ids


@pytest.mark.parametrize("spec", ["fused", "unfused", "ngram"])
def test_neuron_tp2_speculation_through_the_double_equals_the_cpu_reference(ckpt, tmp_path, monkeypatch, spec,
                                                                            reference):
    nxd, _ = install(monkeypatch, 2)
    m = compile_model(ckpt, tmp_path / "n", BUILD.replace(target="neuron", tp_degree=2, speculation=SPECS[spec]),
                      say=lambda m: None)
    assert set(m.extra.speculation.graphs) <= set(m.graphs)
    (trace,) = [c for name, c in nxd.calls if name == "ModelBuilder.trace"]
    assert sorted(trace["keys"]) == sorted(m.graphs)
    if spec == "ngram":                                     # no draft: the plain module, two aliased caches
        assert trace["aliases"] == {"k_cache": 1, "v_cache": 2}
    else:                                                   # every key holds the target shard + the whole draft
        assert trace["aliases"] == {"k_cache": 1, "v_cache": 2, "draft_k_cache": 3, "draft_v_cache": 4}
        assert any(w.startswith("draft.") for w in trace["weights"])
        assert "step.model.model.embed_tokens.start" in trace["weights"]
    model = CompiledModel.load(tmp_path / "n")
    out = model.generate_ids(IDS, NEW, ignore_eos=True)
    assert out.outputs[0].token_ids == reference
    metrics = out.metrics[0]
    assert metrics.spec_steps > 0 and metrics.mode == spec
    shapes = {c["route"] for name, c in nxd.calls if name == "NxDModel.forward"}
    if spec == "fused":                                      # the fused key ran: ids2 [1, 2], uniforms [1, 3K+1]
        assert any("(1, 2), (1, 2), (1, 10), (3,)" in r for r in shapes)
    else:                                                    # the verify key ran: K+1 = 4 tokens
        assert any(r.startswith("[(1, 4), (1, 4), (1, 4)") for r in shapes)


@pytest.fixture(scope="module")
def cs3_like(tmp_path_factory):
    """Tiny target and draft with the CS3 shapes that matter for tp 64: 64 query heads (>= 64 ranks), 8 KV heads
    (replicated over the ranks, as Llama-3.1-405B's), a context of 12800, a shared tokenizer."""
    root = tmp_path_factory.mktemp("cs3")
    shape = {"hidden_size": 512, "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 256,
             "max_position_embeddings": 12800, "num_hidden_layers": 1}
    target = write_tiny_checkpoint(root / "target", **shape)
    draft = write_tiny_checkpoint(root / "draft", seed=1, **{**shape, "num_attention_heads": 32})
    return target, draft


def test_the_cs3_preset_compiles_through_the_double_at_tp64(cs3_like, tmp_path, monkeypatch):
    target, draft = cs3_like
    preset = load_preset("cs3-llama3.1-405b-fp8-fused-spec-trn2")
    build = preset.build.replace(speculation=dataclasses.replace(preset.build.speculation, draft_model=str(draft)))
    assert build.tp_degree == 64 and build.speculation.length == 7 and build.speculation.fused
    nxd, _ = install(monkeypatch, 64)
    m = compile_model(target, tmp_path / "cs3", build, say=lambda m: None)
    assert m.backend == "neuron" and m.build.quant.scheme == "fp8"
    spec = m.extra.speculation
    assert {"fused_greedy_k7_s12800", "fused_sample_k7_s12800", "verify_t8_s12800"} <= set(spec.graphs)
    assert {f"draft_context_t{t}_s{t}" for t in (2048, 4096, 10240, 12288)} <= set(spec.graphs)
    (trace,) = [c for name, c in nxd.calls if name == "ModelBuilder.trace"]
    target_graphs = {g.name for g in planned_graphs(build)}  # context (prefix attends included) and tokengen
    assert target_graphs <= set(m.graphs) and "context_t2048_s12288" in target_graphs
    # draft context x4, draft tokengen t1/t2/t8 (t8: the draft's catch-up), verify, fused greedy/sample
    assert sorted(trace["keys"]) == sorted(m.graphs) and len(m.graphs) == len(target_graphs) + 4 + 3 + 1 + 2
    assert trace["aliases"] == {"k_cache": 1, "v_cache": 2, "draft_k_cache": 3, "draft_v_cache": 4}
    (builder,) = [c for name, c in nxd.calls if name == "ModelBuilder"]
    assert builder["tp_degree"] == 64 and builder["logical_nc_config"] == 2
    assert len(m.extra.tp_rank_weights) == 64
    draft_cfg = json.loads((draft / "config.json").read_text())
    assert spec.config.num_heads == draft_cfg["num_attention_heads"]  # the whole draft on every rank
