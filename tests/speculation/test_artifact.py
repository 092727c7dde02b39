"""compile_speculation / load_speculation: draft construction, weights stored once, graphs through every backend.

Backends: cpu-eager (plumbing), the recording double of torch-neuronx (tests/compile/test_neuron_backend.py: the
fused graph is traced and loaded through the Neuron backend's interface), and one compiled graph with the CPU
AOTInductor backend (the fused greedy graph; compiled == eager token for token).
"""
import sys
import types

import pytest

from neuron_infer.artifact.plan import cache_shape, planned_graphs
from neuron_infer.artifact.steps import spec_cache_layout
from neuron_infer.artifact.weights import DRAFT_WEIGHTS, build_float_model
from neuron_infer.backends import get_backend
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.compile.spec_builder import build_draft, compile_speculation
from neuron_infer.config import BuildConfig, ModelConfig, SpeculationConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.spec_step import FusedSpecStep, fused_example_args
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import eager_spec_engine, load_speculation
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

SMALL = BuildConfig(dtype="fp32", max_context_length=16, max_length=32, context_buckets=(16,),
                    tokengen_buckets=(32,))
PROMPT = list(range(5, 15))


def fresh_target(model_dir, build):
    cfg = ModelConfig.from_model_dir(model_dir)
    return cfg, build_float_model(cfg, build, load_checkpoint(model_dir, cfg))


def compile_and_load(model_dir, build, out, backend="cpu-eager"):
    """Compile core + speculation graphs into `out`, then load them onto freshly built weights (as generate does:
    the Neuron double poisons the weights of the modules it traces)."""
    be, gdir = get_backend(backend), out / "graphs"
    gdir.mkdir(parents=True, exist_ok=True)
    cfg, target = fresh_target(model_dir, build)
    from neuron_infer.artifact.plan import example_args

    for spec in planned_graphs(build):
        step = BucketStep(target, spec.attend)
        be.compile_graph(step, example_args(cache_shape(target, build), spec), gdir, spec.name)
    meta, record = compile_speculation(model_dir, cfg, build, target, be, out, lambda m: None)
    _, target = fresh_target(model_dir, build)
    core = {s.name: be.load_graph(gdir, s.name, BucketStep(target, s.attend))
            for s in planned_graphs(build)}
    engine = Engine(core, build, cache_shape(target, build), cfg.vocab_size)
    manifest = types.SimpleNamespace(build=build, extra=types.SimpleNamespace(speculation=record), backend=backend)
    return meta, record, load_speculation(out, manifest, target, engine)


@pytest.mark.parametrize("spec, stored", [
    (SpeculationConfig("self", 3, fused=True, draft_layers=1), False),  # float truncation: every tensor shared
    (SpeculationConfig("self", 2, draft_quant="int8"), True),  # quantized linears stored, norms/embedding shared
])
def test_self_draft_artifact_round_trip(tiny_dirs, tmp_path, spec, stored):
    build = SMALL.replace(speculation=spec)
    meta, info, se = compile_and_load(tiny_dirs("gqa"), build, tmp_path)
    assert "model.embed_tokens.weight" in info.shared and "model.norm.weight" in info.shared
    own = (tmp_path / DRAFT_WEIGHTS).stat().st_size > 1024
    assert own == stored
    names = set(meta)
    assert {f"verify_t{spec.length + 1}_s32", "draft_context_t16_s16", "draft_tokengen_t1_s32",
            "draft_tokengen_t2_s32", "draft_tokengen_t8_s32"} <= names  # t8: the draft's catch-up
    assert any(n.startswith("fused_") for n in names) == spec.fused
    # the loaded draft shares the target's tensors (same storage), and generates like a freshly built engine
    d_embed = se.draft.graphs["tokengen_t1_s32"].model.model.embed_tokens.weight
    assert d_embed.data_ptr() == se.target.graphs["tokengen_t1_s32"].model.model.embed_tokens.weight.data_ptr()
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    fresh_target = build_float_model(cfg, build, load_checkpoint(tiny_dirs("gqa"), cfg))
    fresh = eager_spec_engine(fresh_target, build_draft(tiny_dirs("gqa"), cfg, build)[0], build)
    got, m = generate_ids(se, [PROMPT], 16, ignore_eos=True)
    ref, mr = generate_ids(fresh, [PROMPT], 16, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids and m.emitted_per_step == mr.emitted_per_step


def test_draft_checkpoint_with_another_tokenizer_is_a_clear_error(tiny_dirs, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "d", seed=3, tokenizer_vocab_size=300, **TINY_PRESETS["gqa"])
    build = SMALL.replace(speculation=SpeculationConfig(str(other), 2))
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    with pytest.raises(ConfigError, match="different tokenizer"):
        build_draft(tiny_dirs("gqa"), cfg, build)


def test_draft_checkpoint_with_another_vocab_size_is_a_clear_error(tiny_dirs, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "d", seed=3, **{**TINY_PRESETS["gqa"], "vocab_size": 640})
    build = SMALL.replace(speculation=SpeculationConfig(str(other), 2))
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    with pytest.raises(ConfigError, match="vocab_size=640 but the target has 512"):
        build_draft(tiny_dirs("gqa"), cfg, build)


@pytest.mark.parametrize("spec, match", [
    (SpeculationConfig("self", 2, draft_layers=3), "must be in 1..2"),
    (SpeculationConfig("self", 2, draft_quant="int4"), "--draft-quant 'int4' is unknown"),
    (SpeculationConfig("self", 40, draft_layers=1), "needs --max-length >= 41"),
])
def test_bad_speculation_settings_are_clear_errors(tiny_dirs, tmp_path, spec, match):
    from neuron_infer.compile.spec_builder import check_speculation

    with pytest.raises(ConfigError, match=match):
        check_speculation(ModelConfig.from_model_dir(tiny_dirs("gqa")), SMALL.replace(speculation=spec))


def test_missing_fused_graph_names_the_flag(spec_engine):
    from neuron_infer.errors import NeuronInferError

    se = spec_engine(draft="layers1", k=2)
    se.graphs.pop("fused_greedy_k2_s32", None)
    saved = dict(se.graphs)
    se.graphs = {n: g for n, g in saved.items() if not n.startswith("fused_")}
    try:
        with pytest.raises(NeuronInferError, match="--fused-speculation"):
            generate_ids(se.with_mode("fused"), [PROMPT], 4, ignore_eos=True)
    finally:
        se.graphs = saved


def test_fused_graph_goes_through_the_neuron_backend(tiny_dirs, tmp_path, monkeypatch):
    from tests.compile.test_neuron_backend import RecordingNeuronSDK

    sdk = RecordingNeuronSDK()
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    build = SMALL.replace(target="neuron", speculation=SpeculationConfig("self", 3, fused=True, draft_layers=1))
    meta, _, se = compile_and_load(tiny_dirs("gqa"), build, tmp_path, backend="neuron")
    traced = [c["shapes"] for name, c in sdk.calls if name == "trace"]
    fused = [s for s in traced if len(s) == 7 and s[4] == (1, 10)]  # uniforms [B, 3K+1] mark a fused graph
    assert len(fused) == 2 and all(m["files"] for n, m in meta.items() if n.startswith("fused_"))
    loads = [c["keys"] for name, c in sdk.calls if name == "replace_weights"]
    assert any("step.draft.model.embed_tokens.weight" in k and "step.target.lm_head.weight" in k for k in loads)
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    eager_build = build.replace(target="cpu")
    ref = eager_spec_engine(build_float_model(cfg, eager_build, load_checkpoint(tiny_dirs("gqa"), cfg)),
                            build_draft(tiny_dirs("gqa"), cfg, eager_build)[0], eager_build)
    want = generate_ids(ref, [PROMPT], 18, ignore_eos=True)[0][0].token_ids
    assert generate_ids(se.with_mode("fused"), [PROMPT], 18, ignore_eos=True)[0][0].token_ids == want
    assert generate_ids(se.with_mode("unfused"), [PROMPT], 18, ignore_eos=True)[0][0].token_ids == want


def test_fused_graph_compiled_by_the_cpu_backend_equals_eager(tiny_dirs, tmp_path):
    """One AOTInductor graph (the fused greedy step, K=3) against the eager module on the same inputs."""
    build = SMALL.replace(speculation=SpeculationConfig("self", 3, fused=True, draft_layers=1))
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    target = build_float_model(cfg, build, load_checkpoint(tiny_dirs("gqa"), cfg))
    draft = build_draft(tiny_dirs("gqa"), cfg, build)[0]
    layout = spec_cache_layout(target, draft, build)
    module = FusedSpecStep(target, draft, 3, 32, layout, sample=False)
    be = get_backend("cpu")
    be.compile_graph(module, fused_example_args(layout, 3, build.batch_size, 32), tmp_path, "fused_greedy_k3_s32")
    graph = be.load_graph(tmp_path, "fused_greedy_k3_s32", module)
    se = eager_spec_engine(target, draft, build, mode="fused")
    ref = eager_spec_engine(target, draft, build, mode="fused")
    se.graphs["fused_greedy_k3_s32"] = graph
    got, m = generate_ids(se, [PROMPT], 20, ignore_eos=True)
    want, mw = generate_ids(ref, [PROMPT], 20, ignore_eos=True)
    assert got[0].token_ids == want[0].token_ids and m.emitted_per_step == mw.emitted_per_step
