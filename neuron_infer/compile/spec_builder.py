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
    graphs/draft_context_t{T}_s{T}, draft_tokengen_t{1,2}_s{S}, verify_t{K+1}_s{S}   (unfused host loop)
    graphs/fused_{greedy,sample}_k{K}_s{S}                                        (--fused-speculation)
With `--draft-model ngram` (prompt lookup) only the verify graphs are added: no draft weights, no draft graphs.
    manifest.extra["speculation"]     draft config, quantization report, shared tensor names, graph names
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import QUANT_SCHEMES, BuildConfig, ModelConfig, QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.progress import steps
from neuron_infer.runtime.engine import CacheShape, GraphSpec, graph_name
from neuron_infer.runtime.spec_engine import fused_graph_name
from neuron_infer.runtime.spec_step import FusedSpecStep, SpecCacheLayout, fused_example_args

DRAFT_WEIGHTS = "weights/draft_rank0.safetensors"
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
    if build.tp_degree != 1:
        raise ConfigError("speculative decoding is implemented for --tp-degree 1; drop --tp-degree or --draft-model")


def check_same_vocab(target_dir: Path, draft_dir: Path, cfg: ModelConfig, dcfg: ModelConfig) -> None:
    """The draft must score the target's token ids: same vocab_size and, when both have a tokenizer, the same map."""
    from neuron_infer.checkpoint import load_tokenizer
    from neuron_infer.errors import CheckpointError

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
    from neuron_infer.compile.weights import build_float_model

    dcfg, state, source = draft_state(model_dir, cfg, build)
    draft = build_float_model(dcfg, build, state)
    del state
    info = {"source": source, "config": dcfg.to_dict(), "quant": {"scheme": "none"}}
    if build.speculation.draft_quant != "none":
        from neuron_infer.quant import apply_quantization

        info["quant"] = apply_quantization(draft, QuantConfig(scheme=build.speculation.draft_quant)).to_dict()
    return draft, info


# ---- draft weights: stored once, tensors equal to the target's shared ---------------------------------------------
def save_draft_weights(draft: LlamaModel, target: LlamaModel, path: Path) -> list[str]:
    """Write the draft tensors that differ from the target's; return the names taken from the target."""
    tstate, shared, own = target.state_dict(), [], {}
    for name, t in draft.state_dict().items():
        ref = tstate.get(name)
        if ref is not None and ref.dtype == t.dtype and ref.shape == t.shape and torch.equal(ref, t):
            shared.append(name)
        else:
            own[name] = t.contiguous()
    tied = draft.lm_head.weight is draft.model.embed_tokens.weight if hasattr(draft.lm_head, "weight") else False
    if tied and "lm_head.weight" in own:
        own.pop("lm_head.weight")  # re-tied at load
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(path))
    return sorted(shared)


# ---- graphs ---------------------------------------------------------------------------------------------------
def spec_cache_layout(target: LlamaModel, draft: LlamaModel, build: BuildConfig) -> SpecCacheLayout:
    from neuron_infer.compile.builder import cache_shape

    return SpecCacheLayout(cache_shape(target, build), cache_shape(draft, build))


def _step_args(cache: CacheShape, t: int, attend: int, b: int, idx_all: bool) -> tuple[torch.Tensor, ...]:
    """Example inputs of a BucketStep graph with T tokens over b rows (logits at every token when idx_all)."""
    from neuron_infer.compile.builder import example_args

    args = example_args(cache, GraphSpec("x", t, attend, b))
    if idx_all:
        args = args[:4] + (torch.arange(t, dtype=torch.int64).expand(b, t).contiguous(),) + args[5:]  # [B, T]
    return args


def planned_spec_graphs(target: LlamaModel, draft: LlamaModel, build: BuildConfig) -> dict[str, tuple]:
    """name -> (module, example_args) of every speculation graph a build compiles."""
    k, layout, out, b = build.speculation.length, spec_cache_layout(target, draft, build), {}, build.batch_size
    for t in build.context_bucket_list:
        step = BucketStep(draft, t)
        out["draft_" + graph_name("context", t, t)] = (step, _step_args(layout.draft, t, t, 1, False))
    for s in build.tokengen_bucket_list:
        if s < k + 2:
            continue  # a step at position >= 1 needs p + K + 1 <= s slots
        for t in (1, 2):
            step = BucketStep(draft, s)
            out["draft_" + graph_name("tokengen", t, s)] = (step, _step_args(layout.draft, t, s, b, False))
        out[graph_name("verify", k + 1, s)] = (BucketStep(target, s), _step_args(layout.target, k + 1, s, b, True))
        if build.speculation.fused:
            for sample in (False, True):
                out[fused_graph_name(k, s, sample)] = (FusedSpecStep(target, draft, k, s, layout, sample),
                                                       fused_example_args(layout, k, b, s))
    return out


def planned_verify_graphs(target: LlamaModel, build: BuildConfig) -> dict[str, tuple]:
    """name -> (module, example_args) of the target's verify graphs alone (prompt lookup: no draft model)."""
    from neuron_infer.compile.builder import cache_shape

    k, cache = build.speculation.length, cache_shape(target, build)
    return {graph_name("verify", k + 1, s): (BucketStep(target, s),
                                             _step_args(cache, k + 1, s, build.batch_size, True))
            for s in build.tokengen_bucket_list if s >= k + 2}


def compile_speculation(model_dir: Path, cfg: ModelConfig, build: BuildConfig, target: LlamaModel, backend,
                        out_dir: Path, say: Progress) -> tuple[dict, dict]:
    """Build the draft, save its weights and compile the speculation graphs into `out_dir` (the artifact being
    written). Returns (graphs metadata to merge into the manifest's graphs, {"speculation": ...} for extra).
    Prompt lookup (`--draft-model ngram`) compiles the verify graphs only: no draft, no draft weights."""
    check_speculation(cfg, build)
    if build.speculation.is_ngram:
        info = {"source": "ngram", "ngram_size": build.speculation.ngram}
        plan, meta = planned_verify_graphs(target, build), {}
    else:
        draft, info = build_draft(Path(model_dir), cfg, build)
        info["shared"] = save_draft_weights(draft, target, out_dir / DRAFT_WEIGHTS)
        plan, meta = planned_spec_graphs(target, draft, build), {}
    (out_dir / "graphs").mkdir(parents=True, exist_ok=True)
    for name, (module, args) in steps(plan.items(), "compiling speculation graph", say,
                                      lambda item: f"{item[0]} ({backend.name})", unit="graph"):
        t0 = time.perf_counter()
        with torch.inference_mode():
            m = backend.compile_graph(module, args, out_dir / "graphs", name)
        meta[name] = {"kind": name.split("_t")[0].split("_k")[0], "seconds": round(time.perf_counter() - t0, 3), **m}
    info.update({"length": build.speculation.length, "fused": build.speculation.fused, "graphs": sorted(meta)})
    return meta, {"speculation": info}
