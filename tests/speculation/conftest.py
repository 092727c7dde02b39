"""Speculation fixtures: tiny targets, drafts of chosen quality, eager SpecEngines cached per configuration.

Drafts (all share the target's vocabulary):
  "layers1" self-draft of the target's first layer (of 2): partial acceptance, many rejections
  "full"    self-draft of both layers: the target itself, every greedy draft accepted (bonus tokens, EOS and
            max length inside accepted blocks)
  "int8"    self-draft quantized to int8: high but imperfect acceptance
  "other"   an unrelated tiny checkpoint (another seed, same tokenizer): almost every draft rejected
"""
from __future__ import annotations

import pytest
import torch

from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.compile.spec_builder import build_draft
from neuron_infer.config import BuildConfig, ModelConfig, SpeculationConfig
from neuron_infer.runtime.loader import eager_spec_engine
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

BASE = BuildConfig(dtype="fp32", max_context_length=32, max_length=96, context_buckets=(16, 32),
                   tokengen_buckets=(32, 64, 96))


def spec_config(draft: str, k: int, other_dir=None, fused: bool = True) -> SpeculationConfig:
    if draft == "layers1":
        return SpeculationConfig("self", k, fused=fused, draft_layers=1)
    if draft == "full":
        return SpeculationConfig("self", k, fused=fused, draft_layers=2)
    if draft == "int8":
        return SpeculationConfig("self", k, fused=fused, draft_quant="int8")
    return SpeculationConfig(str(other_dir), k, fused=fused)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: one thread. On this shared 2-core machine under load, 2 OpenMP threads made this suite ~10x
    slower (measured: 165 s vs 20 s for the greedy tests). Restored after each test, so other areas keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def other_draft_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "other", seed=1, **TINY_PRESETS["gqa"])


@pytest.fixture(scope="session")
def spec_engine(tiny_dirs, other_draft_dir):
    """(preset, draft, k, build overrides...) -> eager SpecEngine (cached; every graph is the module itself)."""
    cache = {}

    def get(preset="gqa", draft="layers1", k=4, mode="unfused", **build_kw):
        key = (preset, draft, k, mode, tuple(sorted(build_kw.items())))
        if key not in cache:
            d = tiny_dirs(preset)
            cfg = ModelConfig.from_model_dir(d)
            build = BASE.replace(speculation=spec_config(draft, k, other_draft_dir), **build_kw)
            target = build_float_model(cfg, build, load_checkpoint(d, cfg))
            dmodel, _ = build_draft(d, cfg, build)
            cache[key] = eager_spec_engine(target, dmodel, build, mode)
        return cache[key]

    return get
