"""`compile`: checkpoint dir -> artifact dir (weights per rank, one graph per (sub-model, bucket), manifest last)."""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from neuron_infer.checkpoint import check_tokenizer, checkpoint_fingerprint, load_checkpoint
from neuron_infer.compile.artifact import FORMAT_VERSION, Manifest, atomic_directory, hash_tree, package_versions
from neuron_infer.compile.artifact import write_manifest
from neuron_infer.compile.graph_cache import cached_compile, cached_lookup, graph_key
from neuron_infer.compile.quantize_step import quantize_model
from neuron_infer.compile.weights import build_float_model, save_rank_weights
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.oserrors import check_output_location, writing_to
from neuron_infer.progress import steps
from neuron_infer.runtime.engine import CacheShape, GraphSpec, ShapeClass, planned_graphs, shape_class

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")
Progress = Callable[[str], None]


def check_build_against_model(cfg: ModelConfig, build: BuildConfig) -> None:
    """Combinations that only fail once the model is known."""
    if build.max_length > cfg.max_position_embeddings:
        raise ConfigError(
            f"--max-length {build.max_length} exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}; lower --max-length"
        )
    check_kv_cache_fits(cfg, build)
    if build.target == "cpu" and build.tp_degree != 1:
        from neuron_infer.parallel.plan import ShardPlan  # noqa: PLC0415  (validates the degree)

        ShardPlan.build(cfg, build.tp_degree)
    if build.speculation is not None:
        from neuron_infer.compile.spec_builder import check_speculation  # noqa: PLC0415

        check_speculation(cfg, build)


def check_kv_cache_fits(cfg: ModelConfig, build: BuildConfig) -> None:
    """The default KV cache (batch_size sequences of max_length, K and V, all ranks together) must fit the machine's
    memory: a sizing error names the fix instead of an allocation failure at load."""
    import psutil  # noqa: PLC0415

    elem = 4 if build.dtype == "fp32" else 1 if build.quant.kv_cache_dtype == "fp8" else 2
    need = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * build.batch_size * build.max_length
    have = psutil.virtual_memory().total
    if need > have:
        raise ConfigError(f"--batch-size {build.batch_size} x --max-length {build.max_length} needs a KV cache of "
                          f"{need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB of memory; lower "
                          "--batch-size or --max-length")


def source_dirs(model_dir: Path, build: BuildConfig) -> list[Path]:
    """The input directories of a compile (which its output must never replace)."""
    draft = build.speculation.draft_model if build.speculation is not None else None
    return [Path(model_dir)] + ([Path(draft)] if draft not in (None, "self", "ngram") else [])


def example_args(cache: CacheShape, spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Static-shape example inputs of one step graph (see runtime.engine for the signatures)."""
    b, t = spec.batch, spec.tokens
    k, v = cache.allocate()
    ids = torch.zeros(b, t, dtype=torch.int64)  # [B, T]
    pos = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()  # [B, T]
    idx = torch.full((b, spec.logit_rows), t - 1, dtype=torch.int64)  # [B, R] (R = 1 but for the prefill class)
    if spec.kind == "verify":
        idx = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()  # [B, T]
    table = torch.zeros(b, spec.attend // cache.block_size, dtype=torch.int64)  # [B, S/bs]
    return ids, pos, k, v, idx, table


def cache_shape(model: LlamaModel, build: BuildConfig, blocks: int | None = None) -> CacheShape:
    """The KV cache of one rank: `blocks` blocks (default: build.default_kv_blocks)."""
    dtype = torch.float32 if build.dtype == "fp32" else torch.bfloat16
    if build.quant.kv_cache_dtype == "fp8":
        dtype = torch.float8_e4m3fn
    return CacheShape(model.cfg.num_layers, blocks or build.default_kv_blocks, model.layout.num_kv_heads,
                      build.block_size, model.cfg.head_dim, dtype)


def compile_graphs(model: LlamaModel, build: BuildConfig, backend, graphs_dir: Path, say: Progress,
                   weights: Path | None = None) -> dict:
    """Compile every planned (sub-model, bucket) graph of one rank's model. A backend with dynamic shapes (CPU)
    compiles one graph per shape class (runtime.engine.shape_class) and records it under every bucket it serves,
    through the compile cache; with `weights` (the rank's weights file, already written) graphs missing from the
    cache compile in parallel worker processes (compile/graph_workers.py)."""
    graphs_dir.mkdir(parents=True, exist_ok=True)
    plan = planned_graphs(build)
    if not getattr(backend, "dynamic_shapes", False):
        return _compile_static(model, build, backend, graphs_dir, say, plan, weights)
    classes: dict[str, ShapeClass] = {}
    for spec in plan:
        classes.setdefault(shape_class(spec, build).name, shape_class(spec, build))
    compiled = compile_classes(model, build, backend, graphs_dir, say, list(classes.values()), weights)
    out = {}
    for spec in plan:
        cls = shape_class(spec, build)
        out[spec.name] = {"kind": spec.kind, "tokens": spec.tokens, "attend": spec.attend, "batch": spec.batch,
                          **compiled[cls.name], "graph": cls.name, "dynamic": sorted(cls.dims)}
    return out


def _compile_static(model, build, backend, graphs_dir: Path, say: Progress, plan: list[GraphSpec],
                    weights: Path | None) -> dict:
    """Static-shape buckets: through the backend's own compile of a whole plan when it has one (neuron: NEFF cache
    and worker processes, compile/neuron_workers.py), else one by one."""
    if hasattr(backend, "compile_buckets"):
        return backend.compile_buckets(model, build, graphs_dir, say, plan, weights)
    return _compile_buckets(model, build, backend, graphs_dir, say, plan)


def _compile_buckets(model, build, backend, graphs_dir: Path, say: Progress, plan: list[GraphSpec]) -> dict:
    """One static-shape graph per planned bucket (Neuron, eager)."""
    shape, out = cache_shape(model, build), {}
    for spec in steps(plan, "compiling", say, lambda s: f"{s.name} ({backend.name})", unit="graph"):
        t0 = time.perf_counter()
        with torch.inference_mode():
            meta = backend.compile_graph(BucketStep(model, spec.attend), example_args(shape, spec), graphs_dir,
                                         spec.name)
        out[spec.name] = {"kind": spec.kind, "tokens": spec.tokens, "attend": spec.attend, "batch": spec.batch,
                          "seconds": round(time.perf_counter() - t0, 3), **meta}
    return out


def compile_classes(model, build, backend, graphs_dir: Path, say: Progress, classes: list[ShapeClass],
                    weights: Path | None = None) -> dict[str, dict]:
    """Shape-class graphs: cache hits copied, misses compiled (in worker processes when there are several)."""
    shape, out, misses = cache_shape(model, build), {}, []
    for cls in classes:
        key = class_key(model, build, backend, shape, cls)
        t0 = time.perf_counter()
        meta = cached_lookup(key, graphs_dir)
        if meta is None:
            misses.append((cls, key))
        else:
            out[cls.name] = {**meta, "seconds": round(time.perf_counter() - t0, 3)}
            say(f"{cls.name}: compiled graph reused from the compile cache")
    if len(misses) > 1 and weights is not None and backend.name == "cpu":
        from neuron_infer.compile.graph_workers import compile_in_workers  # noqa: PLC0415  (cycle: workers -> here)

        out.update(compile_in_workers(misses, weights, model.cfg, build, graphs_dir, say))
        return out
    for cls, key in steps(misses, "compiling", say, lambda j: f"{j[0].name} ({backend.name})", unit="graph"):
        out[cls.name] = compile_class(model, build, graphs_dir, cls, key, backend)
    return out


def class_key(model: LlamaModel, build: BuildConfig, backend, shape: CacheShape, cls: ShapeClass) -> str:
    """The compile-cache key of a shape-class graph (compile/graph_cache.py says what it covers)."""
    step, args = BucketStep(model, cls.example.attend), example_args(shape, cls.example)
    tensors = {k: [list(t.shape), str(t.dtype)] for k, t in step.state_dict(keep_vars=True).items()}
    return graph_key({"backend": backend.cache_key(), "model": model.cfg.to_dict(), "build": build.to_dict(),
                      "class": cls.name, "example": dataclasses.asdict(cls.example), "dynamic": cls.dynamic,
                      "args": [[list(a.shape), str(a.dtype)] for a in args], "tensors": tensors})


def compile_class(model: LlamaModel, build: BuildConfig, graphs_dir: Path, cls: ShapeClass, key: str,
                  backend=None) -> dict:
    """Compile one shape-class graph into graphs_dir and store it in the compile cache under `key`."""
    from neuron_infer.compile.backend import get_backend  # noqa: PLC0415  (lazy: backends import torch's compiler)

    backend = backend or get_backend("cpu")
    step, args = BucketStep(model, cls.example.attend), example_args(cache_shape(model, build), cls.example)
    t0 = time.perf_counter()

    def compile_into(out_dir: Path) -> dict:
        with torch.inference_mode():
            return backend.compile_graph(step, args, out_dir, cls.name, dynamic=cls.dynamic)

    return {**cached_compile(key, graphs_dir, compile_into), "seconds": round(time.perf_counter() - t0, 3)}


def copy_tokenizer(model_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, dst / name)


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
            from neuron_infer.compile.tp import compile_tp_model  # noqa: PLC0415

            return compile_tp_model(model_dir, out_dir, build, backend=backend, overwrite=overwrite, say=say)
        return _compile_one_rank(model_dir, out_dir, build, backend, overwrite, say)


def _compile_one_rank(model_dir: str | Path, out_dir: str | Path, build: BuildConfig, backend: str | None,
                      overwrite: bool, say: Progress) -> Manifest:
    from neuron_infer.compile.backend import get_backend  # noqa: PLC0415  (lazy: neuron SDK only when asked)

    t_start = time.perf_counter()
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    check_build_against_model(cfg, build)
    check_tokenizer(model_dir, cfg)
    be = get_backend(backend or build.target)
    if hasattr(be, "bind_build"):  # neuron: the build's logical-NeuronCore degree (compile/neuron_platform.py)
        be.bind_build(build)
    with atomic_directory(Path(out_dir), overwrite, source_dirs(model_dir, build)) as tmp:
        state = load_checkpoint(model_dir, cfg)
        model = build_float_model(cfg, build, state)
        del state
        extra = {"quant": quantize_model(model, build, model_dir)}
        save_rank_weights(model, tmp / "weights" / "rank0.safetensors")
        graphs = compile_graphs(model, build, be, tmp / "graphs", say, weights=tmp / "weights" / "rank0.safetensors")
        if build.speculation is not None:
            from neuron_infer.compile.spec_builder import compile_speculation  # noqa: PLC0415

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
