"""Speculative decoding at compile and load time: the draft model, its weights, and the extra graphs.

    graphs_meta, extra = compile_speculation(model_dir, cfg, build, target_model, backend, tmp_dir, say)

(loaded by runtime.loader.load_rank).

The draft is either
* a checkpoint directory (`--draft-model DIR`) with the target's vocabulary (same vocab_size, and the same
  token -> id map when both ship a tokenizer), or
* a self-draft (`--draft-model self`) built from the target checkpoint: its first N layers (`--draft-layers N`,
  sharing the embedding, final norm and lm_head) and/or quantized (`--draft-quant int8|fp8|mxfp8|mxfp4|w8a8`).

Artifact additions:
    weights/draft_rank0.safetensors   the draft tensors that differ from the target's (a float truncated self-draft
                                      of a float target stores nothing: every tensor is the target's, shared in memory)
                                      At tp > 1 the draft is replicated: this one file serves every rank, and only
                                      the norms (whole on every rank) are shared with the target's shard.
    graphs/draft_context_t{T}_s{T}, draft_tokengen_t{1,2}_s{S}, verify_t{K+1}_s{S}   (unfused host loop)
    graphs/draft_tokengen_t8_s{S}                   (the draft's catch-up, 8 positions per pass; S >= 8)
    graphs/fused_{greedy,sample}_k{K}_s{S}                                        (--fused-speculation)
    (at tp > 1 under graphs/rank{r}/ on CPU: rank r's target shard with the whole draft, which has no collectives)
With `--draft-model ngram` (prompt lookup) only the verify graphs are added: no draft weights, no draft graphs.
    manifest extra.speculation       draft config, quantization report, shared tensor names, graph names (SpeculationRecord)
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from neuron_infer.artifact.plan import shape_class, spec_graph_list
from neuron_infer.artifact.records import SpeculationRecord
from neuron_infer.artifact.steps import speculation_modules
from neuron_infer.artifact.weights import DRAFT_WEIGHTS, build_float_model, save_draft_weights
from neuron_infer.checkpoint import load_checkpoint, load_tokenizer
from neuron_infer.compile.graphs import compile_classes
from neuron_infer.config import QUANT_SCHEMES, BuildConfig, ModelConfig, QuantConfig
from neuron_infer.errors import CheckpointError, ConfigError
from neuron_infer.model.llama import LlamaModel
from neuron_infer.progress import steps
from neuron_infer.quant import apply_quantization
from neuron_infer.typed import parse_dataclass

Progress = Callable[[str], None]


# ---- the draft model ---------------------------------------------------------------------------------------------
def check_speculation(cfg: ModelConfig, build: BuildConfig) -> None:
    """Combinations that only fail once the target model is known."""
    spec = build.speculation
    if spec.draft_quant not in QUANT_SCHEMES:
        raise ConfigError(f"--draft-quant {spec.draft_quant!r} is unknown; choose one of {', '.join(QUANT_SCHEMES)}")
    if spec.draft_layers is not None and not 1 <= spec.draft_layers <= cfg.num_layers:
        raise ConfigError(f"--draft-layers {spec.draft_layers} must be in 1..{cfg.num_layers} (the target's layers)")
    if spec.length + 1 > build.max_length:
        raise ConfigError(f"--speculation-length {spec.length} needs --max-length >= {spec.length + 1}")


def check_same_vocab(target_dir: Path, draft_dir: Path, cfg: ModelConfig, dcfg: ModelConfig) -> None:
    """The draft must score the target's token ids: same vocab_size and, when both have a tokenizer, the same map."""
    if dcfg.vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"draft {draft_dir} has vocab_size={dcfg.vocab_size} but the target has {cfg.vocab_size}: draft and "
            "target must share a tokenizer; pick a draft from the same model family (or use --draft-model self)")
    try:
        tt, dt = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    except CheckpointError:
        return  # one side ships no tokenizer: the vocab_size check is all we can do
    if tt.get_vocab() != dt.get_vocab():
        raise ConfigError(
            f"draft {draft_dir} has a different tokenizer (token -> id map) than the target {target_dir}: draft and "
            "target must share a tokenizer; pick a draft from the same model family (or use --draft-model self)")


def draft_state(model_dir: Path, cfg: ModelConfig, build: BuildConfig) -> tuple[ModelConfig, dict, str]:
    """(draft ModelConfig, HF-named float tensors, description) for the build's speculation config."""
    spec = build.speculation
    if spec.draft_model != "self":
        ddir = Path(spec.draft_model)
        dcfg = ModelConfig.from_model_dir(ddir)
        check_same_vocab(Path(model_dir), ddir, cfg, dcfg)
        if build.max_length > dcfg.max_position_embeddings:
            raise ConfigError(f"--max-length {build.max_length} exceeds the draft's max_position_embeddings="
                              f"{dcfg.max_position_embeddings}; lower --max-length or pick another draft")
        return dcfg, load_checkpoint(ddir, dcfg), str(ddir)
    n = spec.draft_layers or cfg.num_layers
    dcfg = dataclasses.replace(cfg, num_layers=n)
    state = load_checkpoint(model_dir, cfg)
    keep = {f"model.layers.{i}." for i in range(n)}
    state = {k: v for k, v in state.items() if not k.startswith("model.layers.") or k[: k.index(".", 13) + 1] in keep}
    return dcfg, state, f"self(layers={n}/{cfg.num_layers}, quant={spec.draft_quant})"


def build_draft(model_dir: Path, cfg: ModelConfig, build: BuildConfig) -> tuple[LlamaModel, dict]:
    """The draft model (float, then quantized with --draft-quant) and a description for the manifest."""
    dcfg, state, source = draft_state(model_dir, cfg, build)
    draft = build_float_model(dcfg, build, state)
    del state
    info = {"source": source, "config": dcfg.to_dict(), "quant": {"scheme": "none"}}
    if build.speculation.draft_quant != "none":
        info["quant"] = apply_quantization(draft, QuantConfig(scheme=build.speculation.draft_quant)).to_dict()
    return draft, info


# ---- graphs ---------------------------------------------------------------------------------------------------
def prepare_speculation(model_dir: Path, cfg: ModelConfig, build: BuildConfig, target: LlamaModel, out_dir: Path,
                        shareable: Callable[[str], bool] = lambda name: True) -> tuple[LlamaModel | None, dict]:
    """Check the config, build the draft and save its weights into `out_dir` (the artifact being written) ->
    (draft, manifest info); (None, info) for prompt lookup (`--draft-model ngram`: no draft, no draft weights).
    `target`: the target model (rank 0's shard at tp > 1, see save_draft_weights)."""
    check_speculation(cfg, build)
    if build.speculation.is_ngram:
        return None, {"source": "ngram", "ngram_size": build.speculation.ngram}
    draft, info = build_draft(Path(model_dir), cfg, build)
    info["shared"] = save_draft_weights(draft, target, out_dir / DRAFT_WEIGHTS, shareable)
    return draft, info


def compile_spec_graphs(target: LlamaModel, draft: LlamaModel | None, build: BuildConfig, backend,
                        graphs_dir: Path, say: Progress) -> dict:
    """Compile the speculation graphs of one rank's target (and the whole draft) into `graphs_dir` -> metadata.
    Prompt lookup on a backend with dynamic shapes: one verify graph for every attended length (a shape class)."""
    meta = {}
    graphs_dir.mkdir(parents=True, exist_ok=True)
    if draft is None and getattr(backend, "dynamic_shapes", False):
        return _compile_verify_classes(target, build, backend, graphs_dir, say)
    specs = {g.name: g for g in spec_graph_list(build, draft=draft is not None)}
    for name, (module, args) in steps(speculation_modules(target, draft, build).items(),
                                      "compiling speculation graph", say,
                                      lambda item: f"{item[0]} ({backend.name})", unit="graph"):
        t0 = time.perf_counter()
        with torch.inference_mode():
            m = backend.compile_graph(module, args, graphs_dir, name)
        g = specs[name]
        meta[name] = {"kind": g.kind, "model": g.model, "tokens": g.tokens, "attend": g.attend, "batch": g.batch,
                      "seconds": round(time.perf_counter() - t0, 3), **m}
    return meta


def _compile_verify_classes(target: LlamaModel, build: BuildConfig, backend, graphs_dir: Path, say: Progress) -> dict:
    """Prompt lookup's verify graphs as shape classes, through the builder's class compile (cache included)."""
    classes = {g.name: shape_class(g, build) for g in spec_graph_list(build, draft=False)}
    unique = list({c.name: c for c in classes.values()}.values())
    done = compile_classes(target, build, backend, graphs_dir, say, unique)
    return {name: {"kind": "verify", **done[c.name], "graph": c.name, "dynamic": sorted(c.dims)}
            for name, c in classes.items()}


def speculation_record(info: dict, build: BuildConfig, graph_names) -> SpeculationRecord:
    """The manifest's record of the speculation (extra.speculation)."""
    return parse_dataclass(SpeculationRecord, {**info, "length": build.speculation.length,
                                               "fused": build.speculation.fused, "graphs": sorted(graph_names)},
                           "the manifest being written", "extra.speculation")


def compile_speculation(model_dir: Path, cfg: ModelConfig, build: BuildConfig, target: LlamaModel, backend,
                        out_dir: Path, say: Progress) -> tuple[dict, SpeculationRecord]:
    """tp = 1: build the draft, save its weights and compile the speculation graphs into `out_dir` (the artifact
    being written). Returns (graphs metadata to merge into the manifest's graphs, the manifest's record).
    Prompt lookup (`--draft-model ngram`) compiles the verify graphs only: no draft, no draft weights."""
    draft, info = prepare_speculation(model_dir, cfg, build, target, out_dir)
    meta = compile_spec_graphs(target, draft, build, backend, out_dir / "graphs", say)
    return meta, speculation_record(info, build, meta)
