"""Generating from a tensor-parallel artifact on CPU: one long-lived rank process per shard, joined by gloo.

`CompiledModel.load` gives a tp > 1 CPU artifact a `RankGroup` instead of an in-process Engine:

1. at load, it checks that this host can run the ranks (`check_cpu_ranks`) before any process starts, then starts
   `tp` rank processes (`RankProcesses`); each loads its own shard once through `load_rank`
   (weights/rank{r}.safetensors, graphs/rank{r}, a KV cache of its local KV heads) and waits for requests;
2. every `generate_ids` call sends the request to every rank; the ranks run `tp_generate_ids` (the token decided
   on rank 0, broadcast); rank 0 streams each step's tokens to this process (`on_tokens`) and returns results and
   metrics. Later calls reuse the same processes and loaded shards: no start-up, no reload;
3. `close()` (also `CompiledModel.close()`, its `with` block, garbage collection and interpreter exit) stops and
   reaps the ranks; ranks whose parent died exit by themselves within about half a second.

A rank that raises, dies (also between calls: the next call reports it) or hangs fails the call with `RankFailure`
naming it, and every rank process is stopped; the group then refuses further calls (load the model again). See
neuron_infer.parallel.launch for the failure detection.

Under torchrun (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE set) nothing is started at load: each call joins that
group as rank RANK, loads the shard and generates once (ranks may then span hosts).
"""
from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from neuron_infer.artifact.manifest import Manifest, read_manifest
from neuron_infer.config import SamplingConfig
from neuron_infer.parallel.launch import (
    RankProcesses,
    all_gather_last_dim,
    broadcast_from_rank0,
    broadcast_object_from_rank0,
    check_cpu_ranks,
    run_ranks,
    torchrun_env_present,
)
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import OnTokens, SequenceResult, generate_ids
from neuron_infer.runtime.loader import load_rank, manifest_plan
from neuron_infer.runtime.metrics import Metrics
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.speculation import Speculation

GREEDY = SamplingConfig()  # temperature 0
DEFAULT_OPTIONS = RunOptions()
DEFAULT_TIMEOUT_S = 600.0  # a rank without a result this long after all ranks joined is reported as hung


def tp_generate_ids(engine: Engine | Speculation, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig = GREEDY,
                    eos_ids: tuple[int, ...] = (), ignore_eos: bool = False, on_tokens: OnTokens | None = None,
                    collect_logits: bool = False, options: RunOptions = DEFAULT_OPTIONS
                    ) -> tuple[list[SequenceResult], Metrics, list[torch.Tensor]]:
    """The generation loop every rank runs: the token is decided on rank 0 and broadcast, so every rank feeds the
    same next input and takes the same stop decisions (the vocab all-gather already hands every rank identical
    logits; the broadcast makes that independent of the sampler). Returns (results, metrics, each step's logits of
    the real rows when `collect_logits`: tests compare them against tp = 1)."""
    seen: list[torch.Tensor] = []
    results, metrics = generate_ids(engine, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, on_tokens,
                                    agree=broadcast_from_rank0,  # [n] rank 0's choice everywhere
                                    on_logits=(lambda t: seen.append(t.clone())) if collect_logits else None,
                                    options=options)
    return results, metrics, seen


def serve_rank(ctx, root: str, kv_cache_gib: float | None = None):
    """Set-up of every rank (module level: spawned processes import it): load this rank's shard once (a KV cache of
    `kv_cache_gib` per rank, None: the build's default); returns the handler that serves each request."""
    root_p = Path(root)
    manifest = read_manifest(root_p, verify_files=False)  # the parent verified the files once
    engine = load_rank(root_p, ctx.rank, manifest, kv_cache_gib=kv_cache_gib)
    return functools.partial(_serve_request, ctx, engine)


def _serve_request(ctx, engine: Engine | Speculation, request: dict) -> dict | None:
    """One generate request on this rank's engine. Returns the payload on rank 0."""
    req = broadcast_object_from_rank0(request)  # rank 0's request everywhere (torchrun ranks parse their own argv)
    pids = all_gather_last_dim(torch.tensor([os.getpid()], dtype=torch.int64))  # [tp]
    ctx.emit(("pids", pids.tolist()))
    results, metrics, seen = tp_generate_ids(
        engine, req["prompts"], req["max_new_tokens"], req["sampling"], tuple(req["eos_ids"]), req["ignore_eos"],
        lambda rows: ctx.emit(("tokens", [list(r) for r in rows])), req["collect_logits"],
        req["options"])
    if ctx.rank != 0:
        return None
    return {"results": results, "metrics": [metrics], "logits": [seen], "pids": pids.tolist()}


def rank_main(ctx, root: str, request: dict) -> dict | None:
    """One-shot body (torchrun ranks): load the shard, serve one request."""
    return serve_rank(ctx, root)(request)


class RankGroup:
    """The rank processes of a tensor-parallel CPU artifact (the tokenizer stays in the caller's process)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 180.0

    def __init__(self, root: Path, manifest: Manifest, kv_cache_gib: float | None = None,
                 options: RunOptions = DEFAULT_OPTIONS):
        self.root, self.manifest, self.options = root, manifest, options
        self.plan = manifest_plan(manifest, root)
        self.last_run: dict[str, Any] = {}  # pids and (optionally) logits of the last call, for tests/debugging
        self.procs: RankProcesses | None = None  # None under torchrun: each host launched its own share
        if not torchrun_env_present():
            per_rank = max((r.bytes for r in manifest.extra.tp_rank_weights or ()), default=0)
            check_cpu_ranks(self.plan.tp, per_rank)
            self.procs = RankProcesses(serve_rank, self.plan.tp, (str(root), kv_cache_gib), timeout_s=self.timeout_s,
                                       start_timeout_s=self.start_timeout_s)
            # stops the ranks when this group is garbage-collected or the interpreter exits (holds no ref to self)
            self._finalizer = weakref.finalize(self, self.procs.close)

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids in rank order ([] under torchrun)."""
        return self.procs.pids if self.procs is not None else []

    def close(self) -> None:
        """Stop and reap the rank processes (idempotent)."""
        if self.procs is not None:
            self._finalizer()

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                     eos_ids: tuple[int, ...], ignore_eos: bool, on_tokens: OnTokens | None,
                     collect_logits: bool = False) -> tuple[list[SequenceResult], list[Metrics]] | None:
        """Run the ranks once for all prompts -> (results, [Metrics]);
        None under torchrun on ranks other than 0 (rank 0 holds the results)."""
        request = {"prompts": [list(map(int, p)) for p in prompts], "max_new_tokens": max_new_tokens,
                   "sampling": sampling, "eos_ids": list(eos_ids), "ignore_eos": ignore_eos,
                   "collect_logits": collect_logits, "options": self.options}

        def on_emit(msg: tuple[str, Any]) -> None:
            kind, payload = msg
            if kind == "pids":
                self.last_run["pids"] = payload
            elif on_tokens is not None:
                on_tokens(payload)

        if self.procs is not None:
            out = self.procs.call(request, on_emit)
        else:
            out = run_ranks(rank_main, self.plan.tp, (str(self.root), request), timeout_s=self.timeout_s,
                            start_timeout_s=self.start_timeout_s, on_emit=on_emit)
        if out is None:
            return None
        self.last_run.update(pids=out["pids"], logits=out["logits"])
        return out["results"], out["metrics"]
