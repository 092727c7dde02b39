"""The Neuron target's bucket graphs: cache hits copied, misses traced in parallel worker processes.
NOT YET RUN ON HARDWARE.

    metas = compile_buckets(backend, model, build, graphs_dir, say, plan, weights)     {bucket name: metadata}

The buckets stay static (one NEFF per (sub-model, bucket), as torch_neuronx.trace requires fixed input shapes).
Each is keyed (backends/neuron/cache.py) in this process; the cached ones are copied into the artifact. The rest,
when more than one worker fits (see below) and the SDK is an installed module (a worker imports it; an SDK object
given to NeuronBackend(sdk=...) traces in this process), are traced by worker processes
(`python -m neuron_infer.compile.neuron_worker`, one bucket each, scheduled by compile/graph_workers.run_workers):
each rebuilds the rank's model from the weights file as the loader does, calls `torch_neuronx.trace` once with the
target platform and LNC of this compile, stores the graph in the NEFF cache and prints its metadata.

Processes, not threads: `torch_neuronx.trace` records the graph through torch-xla's lazy tensors (one process-wide
device and graph state) and then runs neuronx-cc on it; its documentation says nothing of concurrent calls in one
process, while separate processes share nothing. Workers are bounded by the usable cores and by the memory
available: NEFF_COMPILE_BYTES per compile plus the weights each worker holds.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from neuron_infer.artifact.plan import cache_shape, example_args
from neuron_infer.backends.graph_cache import cached_lookup
from neuron_infer.backends.neuron.cache import neff_cache_root, neff_key
from neuron_infer.compile.graph_workers import run_workers, worker_count
from neuron_infer.model.llama import BucketStep
from neuron_infer.progress import steps

# Memory budget of one bucket compile (trace + neuronx-cc) beyond the weights: an assumption, not a measurement
# (no compile has run on this target yet). Too small a budget runs more compiles at once than memory holds.
NEFF_COMPILE_BYTES = 8 << 30
MODULE = "neuron_infer.compile.neuron_worker"


def compile_buckets(backend, model, build, graphs_dir: Path, say: Callable[[str], None], plan: list,
                    weights: Path | None) -> dict:
    """{bucket name: its manifest entry} for every planned bucket (GraphSpec) of one rank's model."""
    shape, out, misses, root, digests = cache_shape(model, build), {}, [], neff_cache_root(), {}
    for spec in plan:
        t0 = time.perf_counter()
        step, args = BucketStep(model, spec.attend), example_args(shape, spec)
        with torch.inference_mode():
            key = neff_key(step, args, spec.name, backend.target().record(), backend.compiler_args(), build,
                           digests)
        hit = cached_lookup(key, graphs_dir, root) if key is not None and root is not None else None
        if hit is None:
            misses.append((spec, key))
        else:
            out[spec.name] = _entry(spec, hit, t0)
            say(f"{spec.name}: NEFF reused from the Neuron compile cache")
    n = worker_count(len(misses), weights.stat().st_size, NEFF_COMPILE_BYTES) if weights is not None else 1
    if n > 1 and getattr(backend.sdk, "__file__", None):  # a worker imports the installed SDK, not one given here
        out.update(_in_workers(backend, model, build, graphs_dir, say, misses, weights, n))
        return out
    for spec, key in steps(misses, "compiling", say, lambda job: f"{job[0].name} ({backend.name})", unit="graph"):
        t0 = time.perf_counter()
        with torch.inference_mode():
            meta = backend.compile_keyed(BucketStep(model, spec.attend), example_args(shape, spec), graphs_dir,
                                         spec.name, key)
        out[spec.name] = _entry(spec, meta, t0)
    return out


def _entry(spec, meta: dict, t0: float) -> dict:
    return {"kind": spec.kind, "tokens": spec.tokens, "attend": spec.attend, "batch": spec.batch,
            "seconds": round(time.perf_counter() - t0, 3), **meta}


def _in_workers(backend, model, build, graphs_dir: Path, say, misses: list, weights: Path, n: int) -> dict:
    common = {"target": backend.target().record(), "weights": str(weights), "model": model.cfg.to_dict(),
              "build": build.to_dict(), "graphs_dir": str(graphs_dir)}
    named = [(spec.name, {**common, "spec": dataclasses.asdict(spec), "key": key}) for spec, key in misses]
    metas = run_workers(named, MODULE, n, say)
    return {spec.name: {"kind": spec.kind, "tokens": spec.tokens, "attend": spec.attend, "batch": spec.batch,
                        **metas[spec.name]} for spec, _ in misses}
