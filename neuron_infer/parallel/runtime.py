"""Generating from a tensor-parallel artifact on CPU: one rank process per shard, joined by gloo.

`CompiledModel.load` hands a tp > 1 artifact to `TPCompiledModel` (same generate / generate_ids / encode API).
Each `generate_ids` call:

1. checks that this host can run the ranks (`check_cpu_ranks`, in `load`, before any process starts);
2. starts `tp` rank processes through `run_ranks` (or, when the torchrun variables MASTER_ADDR / MASTER_PORT / RANK /
   WORLD_SIZE are set, joins that group as rank RANK: ranks may then span hosts);
3. every rank loads only its own weights (weights/rank{r}.safetensors) and graphs (graphs/rank{r}), allocates its
   KV cache for its local KV heads only, receives rank 0's request (broadcast: identical inputs everywhere) and runs
   `tp_generate_ids` (token decided on rank 0, broadcast);
4. rank 0 streams each step's tokens to this process (`on_tokens`) and returns results and metrics; the ranks then
   leave the group and exit. A rank that raises, dies or hangs fails the call with `RankFailure` naming it, and
   every rank process is stopped (see neuron_infer.parallel.launch).

Rank processes are started per call: the start-up (importing torch, loading the shard) is paid by every call, which
suits the CLI (one call) more than a long-lived server.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neuron_infer.api import CompiledModel, GenerationOutput, check_token_ids
from neuron_infer.compile.artifact import Manifest, read_manifest
from neuron_infer.compile.builder import cache_shape
from neuron_infer.compile.quantize_step import quant_structure
from neuron_infer.compile.weights import empty_model, load_rank_weights
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ArtifactError, NeuronInferError
from neuron_infer.model.llama import BucketStep
from neuron_infer.parallel.compile_tp import rank_layout, tp_ops
from neuron_infer.parallel.launch import (
    all_gather_last_dim,
    broadcast_object_from_rank0,
    check_cpu_ranks,
    run_ranks,
    torchrun_env_present,
)
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.runtime.engine import Engine, planned_graphs

GREEDY = SamplingConfig()  # temperature 0
DEFAULT_TIMEOUT_S = 600.0  # a rank without a result this long after all ranks joined is reported as hung


def manifest_plan(manifest: Manifest, where: Path) -> ShardPlan:
    """The artifact's shard plan, checked against its model and build."""
    d = manifest.extra.get("tp_plan")
    if d is None:
        raise ArtifactError(f"{where}: manifest extra.tp_plan is missing for tp_degree={manifest.build.tp_degree}; "
                            "recompile the model")
    plan = ShardPlan.from_dict(d)
    if plan.tp != manifest.build.tp_degree or plan != ShardPlan.build(manifest.model, plan.tp):
        raise ArtifactError(f"{where}: the recorded shard plan differs from the one this neuron-infer builds for "
                            f"tp={manifest.build.tp_degree}; recompile the model")
    return plan


def load_rank_engine(root: Path, manifest: Manifest, plan: ShardPlan, rank: int) -> Engine:
    """Rank `rank`'s model skeleton, weights, graphs and (local-KV-head) cache."""
    from neuron_infer.compile.backend import get_backend

    build = manifest.build
    model = empty_model(manifest.model, build, rank_layout(plan.ranks[rank]), tp_ops(build.kernels))
    quant_structure(model, build)
    load_rank_weights(model, root / "weights" / f"rank{rank}.safetensors")
    be = get_backend(manifest.backend)
    graphs = {spec.name: be.load_graph(root / "graphs" / f"rank{rank}", spec.name,
                                       BucketStep(model, spec.attend, spec.select_rows))
              for spec in planned_graphs(build)}
    return Engine(graphs, build, cache_shape(model, build), manifest.model.vocab_size)


def load_serving_rank(root: Path, rank: int, world_size: int, expect_checkpoint: Path | None = None
                      ) -> tuple[Manifest, Engine]:
    """Rank `rank`'s manifest and engine, for a long-lived process that already joined a group of `world_size`
    ranks (one vLLM worker per rank; the model's collectives run on torch.distributed's default group)."""
    from neuron_infer.api import check_checkpoint

    manifest = read_manifest(root, verify_files=True)
    if expect_checkpoint is not None:
        check_checkpoint(manifest, root, expect_checkpoint)
    tp = manifest.build.tp_degree
    if tp != world_size or not 0 <= rank < tp:
        raise ArtifactError(f"{root}: artifact of tp_degree={tp} cannot serve rank {rank} of {world_size}; run it "
                            f"with {tp} ranks (vLLM: --tensor-parallel-size {tp})")
    if manifest.backend == "neuron":
        raise ArtifactError(f"{root}: serving a Neuron tensor-parallel artifact from one process per rank is not "
                            "supported (neuronx-distributed drives every NeuronCore of the group from one process); "
                            "load it with CompiledModel.load instead")
    return manifest, load_rank_engine(root, manifest, manifest_plan(manifest, root), rank)


def rank_main(ctx, root: str, request: dict) -> dict | None:
    """Body of every rank (module level: spawned processes import it). Returns the payload on rank 0."""
    from neuron_infer.parallel.tp_loop import tp_generate_ids

    root_p = Path(root)
    manifest = read_manifest(root_p, verify_files=False)  # the parent verified the files once
    plan = manifest_plan(manifest, root_p)
    engine = load_rank_engine(root_p, manifest, plan, ctx.rank)
    req = broadcast_object_from_rank0(request)  # rank 0's request everywhere (torchrun ranks parse their own argv)
    pids = all_gather_last_dim(torch.tensor([os.getpid()], dtype=torch.int64))  # [tp]
    ctx.emit(("pids", pids.tolist()))
    prompts, bs = req["prompts"], manifest.build.batch_size
    results, metrics, logits = [], [], []
    for start in range(0, len(prompts), bs):
        res, m, seen = tp_generate_ids(
            engine, prompts[start:start + bs], req["max_new_tokens"], req["sampling"], tuple(req["eos_ids"]),
            req["ignore_eos"], lambda rows: ctx.emit(("tokens", [list(r) for r in rows])), req["collect_logits"])
        results += res
        metrics.append(m)
        logits.append(seen)
    if ctx.rank != 0:
        return None
    return {"results": results, "metrics": metrics, "logits": logits, "pids": pids.tolist()}


class TPCompiledModel(CompiledModel):
    """A loaded tensor-parallel artifact: the tokenizer lives here, the shards live in the rank processes."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 180.0

    def __init__(self, root: Path, manifest: Manifest, tokenizer, plan: ShardPlan):
        super().__init__(root, manifest, None, tokenizer)
        self.plan = plan
        self.last_run: dict[str, Any] = {}  # pids and (optionally) logits of the last call, for tests/debugging

    @classmethod
    def from_manifest(cls, root: Path, manifest: Manifest) -> CompiledModel:
        """Called by `CompiledModel.load` (after the manifest and files were verified). CPU: a TPCompiledModel
        (rank processes); Neuron: a CompiledModel whose engine runs neuronx-distributed's TP graphs."""
        from neuron_infer.checkpoint import load_tokenizer

        plan = manifest_plan(manifest, root)
        if manifest.backend == "neuron":  # NxD runs the ranks on NeuronCores from this one process
            from neuron_infer.parallel.neuron_tp import load_neuron_tp_engine

            engine = load_neuron_tp_engine(root, manifest, plan)
            return CompiledModel(root, manifest, engine, load_tokenizer(root / "tokenizer"))
        if not torchrun_env_present():  # under torchrun each host launched its own share; nothing to spawn here
            per_rank = max(r["bytes"] for r in manifest.extra.get("tp_rank_weights", [{"bytes": 0}]))
            check_cpu_ranks(plan.tp, per_rank)
        return cls(root, manifest, plan=plan, tokenizer=load_tokenizer(root / "tokenizer"))

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 64,
                     sampling: SamplingConfig = GREEDY, ignore_eos: bool = False,
                     on_tokens: Callable[[list[list[int]]], None] | None = None,
                     collect_logits: bool = False) -> GenerationOutput:
        """Run the ranks once for all prompts (static batches of batch_size). Under torchrun, ranks other than 0
        return an empty GenerationOutput (rank 0 holds the results)."""
        if max_new_tokens < 1:
            raise NeuronInferError(f"max_new_tokens={max_new_tokens} must be >= 1")
        check_token_ids(prompts, self.manifest.model.vocab_size)
        request = {"prompts": [list(map(int, p)) for p in prompts], "max_new_tokens": max_new_tokens,
                   "sampling": sampling, "eos_ids": list(self.eos_ids), "ignore_eos": ignore_eos,
                   "collect_logits": collect_logits}

        def on_emit(msg):
            kind, payload = msg
            if kind == "pids":
                self.last_run["pids"] = payload
            elif on_tokens is not None:
                on_tokens(payload)

        out = run_ranks(rank_main, self.plan.tp, (str(self.root), request), timeout_s=self.timeout_s,
                        start_timeout_s=self.start_timeout_s, on_emit=on_emit)
        if out is None:  # torchrun, rank != 0
            return GenerationOutput([], [])
        self.last_run.update(pids=out["pids"], logits=out["logits"])
        return GenerationOutput([self._text(r) for r in out["results"]], out["metrics"])

