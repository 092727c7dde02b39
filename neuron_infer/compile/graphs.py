"""Compiling one rank's graphs: the planned graphs of a build (artifact/plan.py) through a backend.

    graphs = compile_graphs(model, build, backend, graphs_dir, say, weights)   -> {graph name: manifest entry}

A backend with dynamic shapes (CPU) compiles one graph per shape class through the compile cache
(backends/graph_cache.py), misses in parallel worker processes (compile/graph_workers.py); a static-shape backend
one graph per bucket (Neuron: its NEFF cache and workers, compile/neuron_workers.py).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch

from neuron_infer.artifact.plan import (
    CacheShape,
    GraphSpec,
    ShapeClass,
    cache_shape,
    example_args,
    planned_graphs,
    shape_class,
)
from neuron_infer.backends import get_backend
from neuron_infer.backends.graph_cache import cached_compile, cached_lookup, graph_key
from neuron_infer.compile.graph_workers import compile_in_workers
from neuron_infer.compile.neuron_workers import compile_buckets
from neuron_infer.config import BuildConfig
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.progress import steps

Progress = Callable[[str], None]


def compile_graphs(model: LlamaModel, build: BuildConfig, backend, graphs_dir: Path, say: Progress,
                   weights: Path | None = None) -> dict:
    """Compile every planned (sub-model, bucket) graph of one rank's model. A backend with dynamic shapes (CPU)
    compiles one graph per shape class (artifact/plan.py shape_class) and records it under every bucket it serves,
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
    """Static-shape buckets: a backend with keyed compiles (neuron) through its NEFF cache and worker processes
    (compile/neuron_workers.py), else one by one."""
    if hasattr(backend, "compile_keyed"):
        return compile_buckets(backend, model, build, graphs_dir, say, plan, weights)
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
    """Shape-class graphs: cache hits copied, misses compiled (in worker processes when the weights file is given)."""
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
    # in workers even when one graph is missing: a worker's model, rebuilt from the weights file, holds its layers
    # stacked, so its graph runs them as one loop (docs/cpu-backend.md), compiled in a fraction of the time
    if misses and weights is not None and backend.name == "cpu":
        out.update(compile_in_workers(misses, weights, model.cfg, build, graphs_dir, say, shape.nbytes()))
        return out
    for cls, key in steps(misses, "compiling", say, lambda j: f"{j[0].name} ({backend.name})", unit="graph"):
        out[cls.name] = compile_class(model, build, graphs_dir, cls, key, backend)
    return out


def class_key(model: LlamaModel, build: BuildConfig, backend, shape: CacheShape, cls: ShapeClass) -> str:
    """The compile-cache key of a shape-class graph (backends/graph_cache.py says what it covers). The weights' values
    are not part of it: a graph holds code only and reads the module's own tensors at load."""
    step, args = BucketStep(model, cls.example.attend), example_args(shape, cls.example)
    tensors = {k: [list(t.shape), str(t.dtype)] for k, t in step.state_dict(keep_vars=True).items()}
    return graph_key({"backend": backend.cache_key(), "model": model.cfg.to_dict(), "build": build.to_dict(),
                      "class": cls.name, "example": dataclasses.asdict(cls.example), "dynamic": cls.dynamic,
                      "args": [[list(a.shape), str(a.dtype)] for a in args], "tensors": tensors})


def compile_class(model: LlamaModel, build: BuildConfig, graphs_dir: Path, cls: ShapeClass, key: str,
                  backend=None) -> dict:
    """Compile one shape-class graph into graphs_dir and store it in the compile cache under `key`."""
    backend = backend or get_backend("cpu")
    step, args = BucketStep(model, cls.example.attend), example_args(cache_shape(model, build), cls.example)
    t0 = time.perf_counter()

    def compile_into(out_dir: Path) -> dict:
        with torch.inference_mode():
            return backend.compile_graph(step, args, out_dir, cls.name, dynamic=cls.dynamic)

    return {**cached_compile(key, graphs_dir, compile_into), "seconds": round(time.perf_counter() - t0, 3)}
