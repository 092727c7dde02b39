"""Independent graphs compiled in parallel worker processes (CPU backend; the scheduler is shared with Neuron).

    metas = compile_in_workers(jobs, weights, cfg, build, graphs_dir, say)     jobs: [(ShapeClass, cache key)]

Compiling a graph is single-threaded Python (export, Inductor's lowering and code generation) and one g++ run, so
two graphs on two cores take about the time of one. Each worker (`python -m neuron_infer.compile.graph_worker`)
rebuilds the rank's model from the weights file the compile already wrote, as the loader does, compiles one graph
through the compile cache and prints its metadata as one JSON line. Workers are bounded by the usable cores and by
the memory available (graph_compile_bytes each, plus the weights).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

from neuron_infer import cpu_threads
from neuron_infer.errors import ArtifactError

WORKER_BYTES = 3 << 30  # peak memory of one graph compile beyond the weights and its example KV cache (SmolLM2
# prefill graph: ~2.4 GiB)
EXAMPLE_CACHE_COPIES = 2  # a graph compile holds its example KV cache (K and V of the build's default cache,
# artifact/plan.py example_args) and the copy torch.export traces (backends/cpu/graph.py _export clones its inputs)


def graph_compile_bytes(cache_bytes: int, base: int = WORKER_BYTES) -> int:
    """Peak memory of one graph compile beyond the weights, for a rank whose default KV cache takes `cache_bytes`
    (`base`: the rest of the compile's peak)."""
    return base + EXAMPLE_CACHE_COPIES * cache_bytes


def worker_count(jobs: int, weight_bytes: int, compile_bytes: int = WORKER_BYTES) -> int:
    """Workers for `jobs` graphs: at most the machine's cores under its CPU quota and what the available memory holds,
    `compile_bytes` plus the weights per worker (at least 1). The caller's own CPU affinity does not bound them: a
    vLLM worker binds itself to its cores, and its compile workers run while it waits (`all_cpus`)."""

    by_memory = psutil.virtual_memory().available // (compile_bytes + weight_bytes)
    return max(1, min(jobs, cpu_threads.usable_cpus(affinity=set(range(os.cpu_count() or 1))), by_memory))


def all_cpus() -> None:
    """Let this compile worker run on every CPU (it inherits the affinity of the process that started it)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the inherited affinity stays


def compile_in_workers(jobs: list, weights: Path, cfg, build, graphs_dir: Path, say: Callable[[str], None],
                       cache_bytes: int = 0) -> dict[str, dict]:
    """Compile each (ShapeClass, key) job in a worker process (`cache_bytes`: the rank's default KV cache, which each
    worker's example inputs hold); -> {class name: metadata}."""
    n = worker_count(len(jobs), weights.stat().st_size, graph_compile_bytes(cache_bytes))
    named = [(cls.name, {"class": {"name": cls.name, "example": cls.example.__dict__,
                                   "dynamic": {str(i): {str(d): list(v) for d, v in dims.items()}
                                               for i, dims in cls.dynamic.items()}},
                         "key": key, "weights": str(weights), "model": cfg.to_dict(), "build": build.to_dict(),
                         "graphs_dir": str(graphs_dir)}) for cls, key in jobs]
    return run_workers(named, "neuron_infer.compile.graph_worker", n, say)


def run_workers(named: list[tuple[str, dict]], module: str, n: int, say: Callable[[str], None]) -> dict[str, dict]:
    """Run each (name, job) as `python -m <module>` (the job as JSON on stdin, its metadata as the last line of
    stdout), at most n at a time; -> {name: metadata}. A failing worker stops the others and raises one
    ArtifactError with its last stderr line. Shared by the CPU and the Neuron backend (compile/neuron_workers.py)."""
    say(f"compiling {len(named)} graph{'s' * (len(named) != 1)} in {n} worker process{'es' * (n != 1)}: "
        + ", ".join(name for name, _ in named))
    pending, running, out, t0 = list(named), {}, {}, time.perf_counter()
    while pending or running:
        while pending and len(running) < n:
            name, job = pending.pop(0)
            running[name] = (_start(module, job), time.perf_counter())
        name, (proc, started) = _wait_any(running)
        del running[name]
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            for p, _ in running.values():
                p.kill()
            lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            raise ArtifactError(f"compiling graph {name} failed: {lines[-1] if lines else 'no output'}")
        out[name] = json.loads(stdout.strip().splitlines()[-1])
        done = len(out)
        say(f"[{done}/{len(named)}] compiled {name} in {time.perf_counter() - started:.1f} s "
            f"({time.perf_counter() - t0:.1f} s elapsed)")
    return out


def _start(module: str, job: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    proc.stdin = None
    return proc


def _wait_any(running: dict) -> tuple[str, tuple]:
    while True:
        for name, item in running.items():
            if item[0].poll() is not None:
                return name, item
        time.sleep(0.05)
