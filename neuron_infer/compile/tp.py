"""`compile` at `tp_degree > 1`: one weight file and one graph directory per rank, the plan in the manifest.

    ARTIFACTS/
      weights/rank{r}.safetensors   rank r's shard only (shard_state_dict), quantized per rank when --quant is set
      graphs/rank{r}/...            rank r's step graphs (backend-specific files; none for cpu-eager)
      manifest.json                 backend, extra["tp_plan"] (ShardPlan.to_dict()), extra["tp_rank_weights"]

CPU: rank graphs run eagerly (backend "cpu-eager", recorded in the manifest). The model's collectives are eager
gloo calls (neuron_infer.parallel.launch) that count progress per rank, which is how a hung rank is named; a compiled
graph would hide them. (A probe showed AOTInductor can compile torch's *functional* all_reduce over gloo on CPU —
38 s for a one-matmul graph per rank on this 2-core host — so compiled CPU rank graphs are possible future work;
they would also have to be compiled inside a live process group.)

Quantization per rank: the compile quantization step (apply_quantization) runs on each rank's float shard. Column-parallel layers (q/k/v, gate/up,
lm_head) have per-output-channel scales identical to tp = 1 (each output row is whole on one rank). Row-parallel
layers (o_proj, down_proj) hold a slice of every output row, so per-channel (int8/fp8/w8a8) scales are computed from
that slice: the quantization is finer than at tp = 1, so quantized TP logits match quantized tp = 1 logits only
within the quantization error, not bit for bit. MX block scales run along the input dimension in blocks of 32 and are
identical to tp = 1 when each rank's input slice is a multiple of 32.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from neuron_infer.checkpoint import check_tokenizer, check_weight_headers, checkpoint_fingerprint, load_checkpoint
from neuron_infer.compile.artifact import (
    FORMAT_VERSION,
    Manifest,
    atomic_directory,
    hash_tree,
    package_versions,
    write_manifest,
)
from neuron_infer.compile.weights import DTYPES, build_float_model, save_rank_weights
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.llama import LlamaModel, LocalLayout
from neuron_infer.model.ops import Ops, get_ops
from neuron_infer.parallel.launch import all_gather_last_dim, all_reduce_sum
from neuron_infer.parallel.plan import RankShard, ShardPlan
from neuron_infer.parallel.shard import shard_state_dict

Progress = Callable[[str], None]

# The backend CPU rank graphs use, and why (also written to the manifest as extra["tp_backend_note"]).
CPU_TP_BACKEND = "cpu-eager"
CPU_TP_NOTE = ("tensor-parallel CPU ranks run their step graphs eagerly (cpu-eager): the gloo collectives between "
               "layers are eager calls that the launcher monitors per rank; compiled CPU rank graphs are not built")


def tp_ops(kernels: str) -> Ops:
    """The op table of a rank: the build's kernels plus the gloo collectives (identity outside a process group)."""
    return get_ops(kernels).with_collectives(all_reduce_sum, all_gather_last_dim)


def rank_layout(shard: RankShard) -> LocalLayout:
    return LocalLayout(**shard.local_layout_fields())


def tp_backend_name(build: BuildConfig, backend: str | None) -> str:
    """The graph backend of a TP compile: CPU ranks always run eagerly (see the module docstring)."""
    name = backend or build.target
    if name in ("cpu", "cpu-eager"):
        return CPU_TP_BACKEND
    if name != "neuron":
        raise ConfigError(f"backend {name!r} cannot run tensor-parallel ranks; use --target cpu or --target neuron")
    return name


def _replicated(name: str) -> bool:
    return name.endswith("norm.weight")  # input/post-attention layernorms and the final norm


def rank_weight_record(model: LlamaModel, rank: int, nbytes: int) -> dict:
    """Bytes of one rank's file split into sharded parts and replicated norms."""
    state = model.state_dict()
    rep = sum(t.numel() * t.element_size() for k, t in state.items() if _replicated(k))
    return {"rank": rank, "bytes": nbytes, "replicated_bytes": rep, "sharded_bytes": nbytes - rep}


def full_sharded_bytes(cfg: ModelConfig, build: BuildConfig, state: dict[str, torch.Tensor]) -> int:
    """Bytes the sharded parameters take at tp = 1 in the build dtype (float; the yardstick for `1/tp`)."""
    elem = torch.empty((), dtype=DTYPES[build.dtype]).element_size()
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in state
    return sum(t.numel() * elem for k, t in state.items()
               if not _replicated(k) and not (tied_head and k == "lm_head.weight"))


def build_rank_model(cfg: ModelConfig, build: BuildConfig, plan: ShardPlan, rank: int,
                     state: dict[str, torch.Tensor], model_dir: Path) -> tuple[LlamaModel, dict]:
    """Rank `rank`'s float model from the full checkpoint state, quantized when the build asks; (model, quant)."""
    from neuron_infer.compile.quantize_step import quantize_model

    mine = shard_state_dict(state, cfg, plan, rank)
    model = build_float_model(cfg, build, mine, rank_layout(plan.ranks[rank]), tp_ops(build.kernels))
    del mine
    return model, quantize_model(model, build, model_dir)


def compile_tp_model(model_dir: str | Path, out_dir: str | Path, build: BuildConfig, *, backend: str | None = None,
                     overwrite: bool = False, say: Progress = print) -> Manifest:
    """Compile `model_dir` for `build.tp_degree` ranks into `out_dir` atomically; returns the manifest."""
    from neuron_infer.compile.backend import get_backend
    from neuron_infer.compile.builder import check_build_against_model, copy_tokenizer, source_dirs

    t_start = time.perf_counter()
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    check_build_against_model(cfg, build)
    check_weight_headers(model_dir, cfg)
    check_tokenizer(model_dir, cfg)
    plan = ShardPlan.build(cfg, build.tp_degree)  # rejects degrees the plan cannot express, before any work
    if build.quant.scheme == "w8a8":
        raise ConfigError("--quant w8a8 calibrates SmoothQuant scales on full-model activations, which a single rank "
                          "does not see; compile w8a8 at --tp-degree 1 (or use int8/fp8/mxfp8/mxfp4 with TP)")
    be_name = tp_backend_name(build, backend)
    be, note = _tp_graph_builder(be_name, get_backend)
    say(f"note: {note}")
    say(f"tensor parallelism: {plan.summary()}")
    with atomic_directory(Path(out_dir), overwrite, source_dirs(model_dir, build)) as tmp:
        state = load_checkpoint(model_dir, cfg)
        records, quant, graphs, spec = _write_ranks(cfg, build, plan, state, model_dir, tmp, be, say)
        if be_name == "neuron":
            from neuron_infer.compile.neuron_tp import compile_neuron_tp_graphs

            graphs = compile_neuron_tp_graphs(tmp, cfg, build, plan, say, spec)
        extra = {
            "tp_plan": plan.to_dict(), "tp_rank_weights": records, "tp_backend_note": note,
            "tp_full_sharded_bytes": full_sharded_bytes(cfg, build, state),
            "quant": quant[0] if build.quant.scheme == "none" else {**quant[0], "per_rank": quant},
        }
        if build.speculation is not None:
            from neuron_infer.compile.spec_builder import speculation_extra

            extra.update(speculation_extra(spec[1], build, [n for n in graphs if _is_spec_graph(n)]))
        del state
        copy_tokenizer(model_dir, tmp / "tokenizer")
        extra["compile_seconds"] = round(time.perf_counter() - t_start, 3)
        manifest = Manifest(FORMAT_VERSION, package_versions(), be_name, cfg, build,
                            checkpoint_fingerprint(model_dir), graphs, hash_tree(tmp), extra)
        write_manifest(tmp, manifest)
    per_rank = max(rec["bytes"] for rec in records)
    say(f"compiled {len(graphs)} graphs x {plan.tp} ranks into {out_dir} ({per_rank / 2**20:.1f} MiB weights/rank) "
        f"in {extra['compile_seconds']:.1f} s")
    return manifest


def _tp_graph_builder(be_name: str, get_backend) -> tuple[object | None, str]:
    """(per-rank graph backend or None, note for the log and manifest)."""
    if be_name == "neuron":
        from neuron_infer.compile.neuron_tp import NEURON_TP_NOTE, import_nxd

        import_nxd()  # fail before any work when neuronx-distributed is absent
        return None, NEURON_TP_NOTE
    return get_backend(be_name), CPU_TP_NOTE


def _write_ranks(cfg, build, plan, state, model_dir, tmp: Path, be, say: Progress
                 ) -> tuple[list, list, dict, tuple | None]:
    """Every rank's weight file (and, with a per-rank backend, its graphs): (byte records, quant reports, graphs,
    (draft model or None, speculation info) when the build speculates, else None). The draft is built and saved
    once (replicated: every rank runs the whole draft, see docs/speculation.md); its graphs join each rank's."""
    from neuron_infer.compile.builder import compile_graphs

    records, quant, graphs, spec = [], [], {}, None
    for r in range(plan.tp):
        model, q = build_rank_model(cfg, build, plan, r, state, model_dir)
        nbytes = save_rank_weights(model, tmp / "weights" / f"rank{r}.safetensors")
        records.append(rank_weight_record(model, r, nbytes))
        quant.append(q)
        if r == 0 and build.speculation is not None:
            from neuron_infer.compile.spec_builder import prepare_speculation

            spec = prepare_speculation(model_dir, cfg, build, model, tmp, _replicated)
        if be is not None:
            rank_say = (lambda m, r=r: say(f"rank {r}: {m}"))
            graphs = _merge_graphs(graphs, compile_graphs(model, build, be, tmp / "graphs" / f"rank{r}", rank_say))
            if spec is not None:
                from neuron_infer.compile.spec_builder import compile_spec_graphs

                meta = compile_spec_graphs(model, spec[0], build, be, tmp / "graphs" / f"rank{r}", rank_say)
                graphs = _merge_graphs(graphs, meta)
        del model
    return records, quant, graphs, spec


def _is_spec_graph(name: str) -> bool:
    return name.startswith(("draft_", "verify_", "fused_"))


def _merge_graphs(graphs: dict, rank_graphs: dict) -> dict:
    """Graph records keyed by name; per-rank files and compile seconds are listed in rank order."""
    for name, meta in rank_graphs.items():
        shared = ("kind", "tokens", "attend", "batch")
        entry = graphs.setdefault(name, {k: meta[k] for k in shared if k in meta} | {"ranks": []})
        entry["ranks"].append({k: v for k, v in meta.items() if k not in shared})
    return graphs
