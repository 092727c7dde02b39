"""`compile`: checkpoint dir -> artifact dir, one pipeline for every tp degree (tp = 1 is the case of one rank).

    ARTIFACTS/
      weights/rank{r}.safetensors   rank r's weights (its shard at tp > 1; quantized, tiled), stored once
      graphs/...                    tp = 1: the rank's graphs; tp > 1: graphs/rank{r}/ (CPU), graphs/nxd_model.pt (Neuron)
      tokenizer/                    the checkpoint's tokenizer files
      manifest.json                 written last; at tp > 1 also the shard plan and the per-rank weight bytes

Per rank: its float model (the whole checkpoint at tp = 1, its shard otherwise), quantized, its weights written,
its graphs compiled (compile/graphs.py: one per shape class where the backend takes dynamic shapes (CPU), else one
per bucket); the draft model (speculation) is built and saved once, with rank 0.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from neuron_infer.artifact.manifest import (
    FORMAT_VERSION,
    Manifest,
    atomic_directory,
    hash_tree,
    package_versions,
    write_manifest,
)
from neuron_infer.artifact.records import ManifestExtra
from neuron_infer.artifact.weights import save_rank_weights
from neuron_infer.backends.neuron.tp_graphs import compile_neuron_tp_graphs
from neuron_infer.checkpoint import check_tokenizer, check_weight_headers, checkpoint_fingerprint, load_checkpoint
from neuron_infer.compile.graphs import compile_graphs
from neuron_infer.compile.inputs import check_build_against_model, copy_tokenizer, source_dirs
from neuron_infer.compile.quantize_step import quantize_model
from neuron_infer.compile.spec_builder import compile_spec_graphs, prepare_speculation, speculation_record
from neuron_infer.compile.tp import RankSet, is_spec_graph
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.oserrors import check_output_location, writing_to
from neuron_infer.text_input import check_path
from neuron_infer.typed import parse_dataclass

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_model(model_dir: str | Path, out_dir: str | Path, build: BuildConfig, *, backend: str | None = None,
                  overwrite: bool = False, say: Progress = _stderr) -> Manifest:
    """Compile `model_dir` into `out_dir` atomically; returns the manifest.

    A full disk, a read-only file system or missing permissions at `out_dir` raise one ArtifactError naming it.
    """
    model_dir, out_dir = check_path(model_dir, "model_dir"), check_path(out_dir, "out_dir")
    check_output_location(Path(out_dir))
    build = build.replace(kv_block_size=build.block_size)  # the manifest records the block size it was built with
    with writing_to(Path(out_dir)):
        return _compile(Path(model_dir), Path(out_dir), build, backend, overwrite, say)


def _compile(model_dir: Path, out_dir: Path, build: BuildConfig, backend: str | None, overwrite: bool,
             say: Progress) -> Manifest:
    t_start = time.perf_counter()
    cfg = ModelConfig.from_model_dir(model_dir)
    check_weight_headers(model_dir, cfg)  # the sizes agree with the weights before anything is sized from them
    check_build_against_model(cfg, build)
    ranks = RankSet.of(cfg, build, backend, say)  # the plan, the graph backend; refusals before any work
    with atomic_directory(out_dir, overwrite, source_dirs(model_dir, build)) as tmp:
        copy_tokenizer(model_dir, tmp / "tokenizer")  # copied first, then the copies checked: what the artifact holds
        check_tokenizer(tmp / "tokenizer", cfg, shown=model_dir)
        state = load_checkpoint(model_dir, cfg)
        graphs, extra, spec = _write_ranks(cfg, build, ranks, state, model_dir, tmp, say)
        if ranks.nxd:  # Neuron at tp > 1: one neuronx-distributed model holds every rank's graphs
            graphs = compile_neuron_tp_graphs(tmp, cfg, build, ranks.plan, say, spec)
        extra.update(ranks.extra(cfg, build, state))
        del state
        if spec is not None:
            extra["speculation"] = speculation_record(spec[1], build, [n for n, g in graphs.items() if is_spec_graph(g)])
        extra["compile_seconds"] = round(time.perf_counter() - t_start, 3)
        manifest = Manifest(FORMAT_VERSION, package_versions(), ranks.backend_name, cfg, build,
                            checkpoint_fingerprint(model_dir), graphs, hash_tree(tmp),
                            parse_dataclass(ManifestExtra, extra, "the manifest being written", "extra"))
        write_manifest(tmp, manifest)
    files = {g.get("graph", name) for name, g in graphs.items()}
    say(f"compiled {len(files)} graph{'s' * (len(files) != 1)}{ranks.times} into {out_dir} "
        f"{ranks.weights_note(extra)}in {extra['compile_seconds']:.1f} s")
    return manifest


def _write_ranks(cfg: ModelConfig, build: BuildConfig, ranks: RankSet, state: dict, model_dir: Path, tmp: Path,
                 say: Progress) -> tuple[dict, dict, tuple | None]:
    """Every rank's weight file and (with a per-rank graph backend) its graphs -> (graph records, manifest extra,
    (draft model or None, speculation info) when the build speculates, else None). The draft is built and saved
    once, with rank 0 (replicated: every rank runs the whole draft); its graphs join each rank's."""
    graphs, quant, records, spec = {}, [], [], None
    for r in range(ranks.tp):
        model = ranks.float_model(cfg, build, state, r)
        quant.append(quantize_model(model, build, model_dir))
        weights = tmp / "weights" / f"rank{r}.safetensors"
        records.append(ranks.weight_record(model, r, save_rank_weights(model, weights)))
        if r == 0 and build.speculation is not None:
            spec = prepare_speculation(model_dir, cfg, build, model, tmp, ranks.shareable)
        if ranks.backend is not None:
            rank_dir, rank_say = ranks.graphs_dir(tmp, r), ranks.rank_say(say, r)
            mine = compile_graphs(model, build, ranks.backend, rank_dir, rank_say, weights=weights)
            if spec is not None:
                mine.update(compile_spec_graphs(model, spec[0], build, ranks.backend, rank_dir, rank_say))
            graphs = ranks.merge_graphs(graphs, mine)
        del model
    return graphs, ranks.quant_extra(build, quant, records), spec
