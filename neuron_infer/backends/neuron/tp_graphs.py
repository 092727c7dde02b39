"""The NxD model of a Neuron tensor-parallel artifact: compile every planned graph with one ModelBuilder, load it
with every rank's weights, and the step callables the runtime's engines run. NOT YET RUN ON HARDWARE.
(backends/neuron/tp.py holds the per-graph pieces and the SDK contract; tp_spec.py the speculation keys.)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from neuron_infer.artifact.plan import planned_graphs, spec_graph_list
from neuron_infer.artifact.weights import rank_model
from neuron_infer.backends.neuron.graph import COMPILER_ARGS, import_sdk
from neuron_infer.backends.neuron.platform import check_runtime, compile_env, resolve_target
from neuron_infer.backends.neuron.support import preflight
from neuron_infer.backends.neuron.tp import (
    NXD_MODEL,
    START,
    StepFactory,
    add_verify_keys,
    check_spmd,
    device_step,
    example_args,
    has_draft,
    import_nxd,
    model_instance,
    no_checkpoint_loader,
    verify_step,
)
from neuron_infer.backends.neuron.tp_spec import add_spec_keys, draft_rank_weights, role_tensor
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ArtifactError
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.rank import rank_layout


def compile_neuron_tp_graphs(root: Path, cfg: ModelConfig, build: BuildConfig, plan: ShardPlan, say,
                             spec: tuple | None = None) -> dict:
    """Trace every planned graph with one ModelBuilder over `plan.tp` NeuronCores into graphs/nxd_model.pt.
    `spec`: (draft model or None, manifest speculation info) when the build speculates (neuron_tp_spec.py)."""
    nxd = import_nxd()
    check_spmd(plan)
    sdk = import_sdk()
    preflight(sdk, build, tp=plan.tp)   # `neuron-infer doctor`'s check, before anything is traced
    target = resolve_target(sdk, build.lnc)
    builder = nxd.trace.model_builder.ModelBuilder(
        router=None, tp_degree=plan.tp, checkpoint_loader=no_checkpoint_loader,
        compiler_workdir=str(root / "graphs" / "nxd.workdir"), logical_nc_config=target.lnc)
    specs, flags = planned_graphs(build), " ".join([*COMPILER_ARGS, *target.compiler_args()])

    def factory_of(attend: int) -> StepFactory:
        return StepFactory(cfg.to_dict(), build.to_dict(), plan.to_dict(), attend, target.lnc)

    records = {g.name: {"kind": g.kind, "tokens": g.tokens, "attend": g.attend, "batch": g.batch} for g in specs}
    if spec is not None and spec[0] is not None:  # a draft model: every key holds target shard + whole draft
        records |= add_spec_keys(nxd, builder, build, specs, factory_of, spec[1], flags)
    else:
        for g in specs:
            builder.add(key=g.name, model_instance=model_instance(nxd, factory_of(g.attend)),
                        example_inputs=[example_args(build, g)], compiler_args=flags)
        if spec is not None:  # prompt lookup: the verify graphs are target graphs over K+1 tokens
            records |= add_verify_keys(nxd, builder, build, factory_of, flags)
    say(f"neuronx-distributed: tracing {len(records)} graphs over {plan.tp} NeuronCores "
        f"({target.platform}, LNC {target.lnc})")
    t0 = time.perf_counter()
    with compile_env(target):
        traced = builder.trace(initialize_model_weights=False)
    (root / "graphs").mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, str(root / "graphs" / NXD_MODEL))
    seconds = round(time.perf_counter() - t0, 3)
    return {name: {**r, "files": [NXD_MODEL], "nxd_key": name, "trace_all_s": seconds, **target.record()}
            for name, r in records.items()}


def rank_weights(root: Path, manifest, plan: ShardPlan, rank: int) -> dict[str, torch.Tensor]:
    """Rank r's weights named as the SPMD step's parameters (tied and quantized structure as at compile)."""
    path = root / "weights" / f"rank{rank}.safetensors"
    model = rank_model(manifest.model, manifest.build, path, rank_layout(plan.ranks[rank]))
    weights = {f"step.model.{k}": v for k, v in model.state_dict().items()}
    if plan.ranks[rank].vocab_local != plan.ranks[rank].vocab_size:
        weights[START] = torch.tensor(plan.ranks[rank].vocab_start, dtype=torch.int64)
    if has_draft(manifest.build):  # the whole draft, the same on every rank
        weights |= draft_rank_weights(root, manifest, model)
    return weights


def load_tp_model(root: Path, manifest, plan: ShardPlan) -> Any:
    """The traced NxD model of an artifact with every rank's weights initialized on its NeuronCore."""
    import_nxd()  # the NxD runtime classes the saved model needs
    lnc = manifest.neuron_lnc  # one degree for every graph (ArtifactError otherwise)
    check_runtime({} if lnc is None else {"lnc": lnc}, f"{root / 'graphs' / NXD_MODEL}")
    try:
        traced = torch.jit.load(str(root / "graphs" / NXD_MODEL))
    except (RuntimeError, OSError) as e:
        raise ArtifactError(f"cannot load the Neuron TP model from {root} ({e}); recompile") from e
    weights = [rank_weights(root, manifest, plan, r) for r in range(plan.tp)]
    traced.nxd_model.initialize(weights, torch.tensor([0], dtype=torch.int32))
    return traced


def core_graphs(traced: Any, build: BuildConfig) -> dict:
    """The engine's step graphs over the NxD model (in a draft-model build: the target role of its keys)."""
    role = None
    if has_draft(build):
        role = role_tensor("target")
    return {spec.name: device_step(traced, spec.attend, role) for spec in planned_graphs(build)}


def verify_graphs(traced: Any, build: BuildConfig) -> dict:
    """Prompt lookup's verify graphs over the NxD model."""
    return {g.name: verify_step(traced, g.attend) for g in spec_graph_list(build, draft=False)}
