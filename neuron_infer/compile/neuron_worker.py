"""A Neuron compile worker process (`python -m neuron_infer.compile.neuron_worker`): one bucket job as JSON on
stdin, its metadata as one JSON line on stdout (compile/neuron_workers.py starts and collects them).
NOT YET RUN ON HARDWARE."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from neuron_infer.artifact.plan import GraphSpec, cache_shape, example_args
from neuron_infer.backends.neuron.graph import NeuronBackend
from neuron_infer.backends.neuron.platform import NeuronTarget
from neuron_infer.compile.graph_worker import worker_model
from neuron_infer.model.llama import BucketStep


def main() -> None:
    """One bucket job from stdin -> its metadata on stdout."""
    job = json.loads(sys.stdin.read())
    model, build = worker_model(job)
    backend = NeuronBackend()
    backend.bind_build(build)
    backend.pin_target(NeuronTarget(**job["target"]))  # the compile's platform and LNC, resolved once
    spec = GraphSpec(**job["spec"])
    t0 = time.perf_counter()
    with torch.inference_mode():
        meta = backend.compile_keyed(BucketStep(model, spec.attend), example_args(cache_shape(model, build), spec),
                                     Path(job["graphs_dir"]), spec.name, job["key"])
    sys.stdout.write(json.dumps({**meta, "seconds": round(time.perf_counter() - t0, 3)}) + "\n")


if __name__ == "__main__":
    main()
