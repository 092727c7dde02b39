"""compile_model -> CompiledModel.load -> generate with speculation (the builder/api/cli integration).

Skipped, with the reason printed, until neuron_infer.compile.builder.compile_model calls compile_speculation
(the integration patch in the speculation report); from then on it checks the whole path.
"""
import json

import pytest

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig, SpeculationConfig

BUILD = BuildConfig(dtype="fp32", max_context_length=32, max_length=64, context_buckets=(32,),
                    tokengen_buckets=(32, 64))
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def artifacts(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("integ")
    spec = BUILD.replace(speculation=SpeculationConfig("self", 4, fused=True, draft_layers=1))
    m = compile_model(tiny_dirs("gqa"), root / "spec", spec, backend="cpu-eager", say=lambda s: None)
    if m.extra.speculation is None:
        pytest.skip("compile_model does not call compile_speculation yet (integration pending)")
    compile_model(tiny_dirs("gqa"), root / "base", BUILD, backend="cpu-eager", say=lambda s: None)
    return CompiledModel.load(root / "spec"), CompiledModel.load(root / "base")


def test_generate_from_a_speculative_artifact_equals_the_target(artifacts):
    spec, base = artifacts
    got = spec.generate_ids([PROMPT], 30, ignore_eos=True)
    want = base.generate_ids([PROMPT], 30, ignore_eos=True)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    d = json.loads(json.dumps(got.to_dict()))  # what `generate --json` prints
    s = d["metrics"]["speculation"]
    assert s["k"] == 4 and s["mode"] == "fused" and 0.0 <= s["acceptance_rate"] <= 1.0
    assert s["mean_accepted_tokens_per_step"] >= 1.0 and d["metrics"]["tokens_per_s"] > 0


def test_sampling_from_a_speculative_artifact_is_seeded(artifacts):
    spec, _ = artifacts
    s = SamplingConfig(temperature=0.9, top_k=30, seed=5)
    a = spec.generate_ids([PROMPT], 16, s, ignore_eos=True).outputs[0].token_ids
    assert a == spec.generate_ids([PROMPT], 16, s, ignore_eos=True).outputs[0].token_ids
