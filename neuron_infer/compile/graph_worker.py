"""A compile worker process (`python -m neuron_infer.compile.graph_worker`): one shape-class job as JSON on stdin,
the compiled graph's metadata as one JSON line on stdout (compile/graph_workers.py starts and collects them)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from neuron_infer.artifact.plan import GraphSpec, ShapeClass
from neuron_infer.artifact.weights import rank_model
from neuron_infer.compile.graph_workers import all_cpus
from neuron_infer.compile.graphs import compile_class
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import NeuronInferError


def worker_model(job: dict):
    """The rank's model of a worker job, rebuilt from the weights file the compile already wrote (as the loader
    does) -> (model, build)."""
    cfg, build = ModelConfig.from_dict(job["model"]), BuildConfig.from_dict(job["build"])
    return rank_model(cfg, build, Path(job["weights"])), build


def main() -> None:
    """One job from stdin -> the graph's metadata on stdout."""
    all_cpus()
    job = json.loads(sys.stdin.read())
    model, build = worker_model(job)
    c = job["class"]
    dynamic = {int(i): {int(d): tuple(v) for d, v in dims.items()} for i, dims in c["dynamic"].items()}
    cls = ShapeClass(c["name"], GraphSpec(**c["example"]), dynamic)
    try:
        meta = compile_class(model, build, Path(job["graphs_dir"]), cls, job["key"])
    except NeuronInferError as e:  # its one line is the last of stderr: the parent's error message
        sys.stderr.write(f"{e}\n")
        raise SystemExit(2) from None
    sys.stdout.write(json.dumps(meta) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
