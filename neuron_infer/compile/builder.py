"""`compile`: checkpoint dir -> artifact dir (weights per rank, one graph per (sub-model, bucket), manifest last)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from neuron_infer.artifact.manifest import (
    FORMAT_VERSION,
    Manifest,
    atomic_directory,
    hash_tree,
    package_versions,
    write_manifest,
)
from neuron_infer.artifact.weights import build_float_model, save_rank_weights
from neuron_infer.backends import get_backend
from neuron_infer.checkpoint import check_tokenizer, checkpoint_fingerprint, load_checkpoint
from neuron_infer.compile.graphs import compile_graphs
from neuron_infer.compile.inputs import check_build_against_model, copy_tokenizer, source_dirs
from neuron_infer.compile.quantize_step import quantize_model
from neuron_infer.compile.spec_builder import compile_speculation
from neuron_infer.compile.tp import compile_tp_model
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.oserrors import check_output_location, writing_to

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_model(model_dir: str | Path, out_dir: str | Path, build: BuildConfig, *, backend: str | None = None,
                  overwrite: bool = False, say: Progress = _stderr) -> Manifest:
    """Compile `model_dir` into `out_dir` atomically; returns the manifest.

    A full disk, a read-only file system or missing permissions at `out_dir` raise one ArtifactError naming it.
    """
    check_output_location(Path(out_dir))
    build = build.replace(kv_block_size=build.block_size)  # the manifest records the block size it was built with
    with writing_to(Path(out_dir)):
        if build.tp_degree != 1:  # per-rank shards and graphs (neuron_infer.compile.tp)
            return compile_tp_model(model_dir, out_dir, build, backend=backend, overwrite=overwrite, say=say)
        return _compile_one_rank(model_dir, out_dir, build, backend, overwrite, say)


def _compile_one_rank(model_dir: str | Path, out_dir: str | Path, build: BuildConfig, backend: str | None,
                      overwrite: bool, say: Progress) -> Manifest:
    t_start = time.perf_counter()
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    check_build_against_model(cfg, build)
    check_tokenizer(model_dir, cfg)
    be = get_backend(backend or build.target)
    if hasattr(be, "bind_build"):  # neuron: the build's logical-NeuronCore degree (backends/neuron/platform.py)
        be.bind_build(build)
    with atomic_directory(Path(out_dir), overwrite, source_dirs(model_dir, build)) as tmp:
        state = load_checkpoint(model_dir, cfg)
        model = build_float_model(cfg, build, state)
        del state
        extra = {"quant": quantize_model(model, build, model_dir)}
        save_rank_weights(model, tmp / "weights" / "rank0.safetensors")
        graphs = compile_graphs(model, build, be, tmp / "graphs", say, weights=tmp / "weights" / "rank0.safetensors")
        if build.speculation is not None:
            spec_graphs, spec_extra = compile_speculation(model_dir, cfg, build, model, be, tmp, say)
            graphs.update(spec_graphs)
            extra.update(spec_extra)
        copy_tokenizer(model_dir, tmp / "tokenizer")
        extra["compile_seconds"] = round(time.perf_counter() - t_start, 3)
        manifest = Manifest(FORMAT_VERSION, package_versions(), be.name, cfg, build,
                            checkpoint_fingerprint(model_dir), graphs, hash_tree(tmp), extra)
        write_manifest(tmp, manifest)
    files = {g.get("graph", name) for name, g in graphs.items()}
    say(f"compiled {len(files)} graph{'s' * (len(files) != 1)} into {out_dir} in {extra['compile_seconds']:.1f} s")
    return manifest
