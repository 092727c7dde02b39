"""Speculative decoding on Neuron at tp > 1: the speculation graphs as keys of the one ModelBuilder (see
neuron_tp.py). NOT YET RUN ON HARDWARE; exercised through the recording neuronx-distributed double.

ModelBuilder shares one weight set and one aliased state among all keys of a traced model, so when the build has a
draft model every key's module (`SpecSPMDStep`) holds the target shard (`step.model.*`, as without a draft), the
whole draft (`draft.*`: replicated, identical on every rank, no collectives; docs/speculation.md says why) and four
device caches, all aliased: k_cache / v_cache (the target's local KV heads) and draft_k_cache / draft_v_cache (all of
the draft's KV heads). Each key runs one role:

    role    graphs                                   inputs
    target  context_*, tokengen_*, verify_t{K+1}_*   ids, positions, logit_index, attend_rows [S], role [1], table
    draft   draft_context_*, draft_tokengen_*        ids, positions, logit_index, attend_rows [S], role [2], table
    fused   fused_{greedy,sample}_k{K}_s{S}          ids2, pos2, uniforms, params, attend_rows [S], role [3 | 4],
                                                     table
table: the block table [B, S/bs]. Both device caches have the same block count and size, so one table addresses
both (as on the host, see runtime/spec_engine.py); the block count is fixed at compile time.

The role tensor (zeros, like attend_rows) only names the graph for NxD's routing by input shapes: a draft graph
has the shapes of the target graph of the same bucket, and the two fused rules share theirs. The fused step is
`spec_step.speculate` bound to the four caches, the same code as the CPU fused graph and the unfused host loop.
Prompt lookup (`--draft-model ngram`) needs no draft: its verify graphs are target keys of the plain SPMDStep.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from neuron_infer.artifact.plan import GraphSpec, spec_graph_list
from neuron_infer.artifact.weights import DRAFT_WEIGHTS, empty_model, load_draft_weights
from neuron_infer.backends.neuron.tp import (
    K_OUT,
    V_OUT,
    DeviceCacheShape,
    StepFactory,
    cache_dtype,
    example_args,
    model_instance,
    rank_cache,
)
from neuron_infer.config import BuildConfig, ModelConfig, QuantConfig
from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.model.nki_neuron import neuron_target
from neuron_infer.model.spec_step import SpecCacheLayout, speculate, uniforms_width
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.quant import apply_quantization

ROLES = {"target": 1, "draft": 2, "fused_greedy": 3, "fused_sample": 4}  # role tensor length per role
DK_OUT, DV_OUT = 3, 4  # output indices of the updated draft caches


def _cache_param(c: CacheShape) -> nn.Parameter:
    return nn.Parameter(torch.empty(c.dims, dtype=c.dtype, device="meta"), requires_grad=False)


class SpecSPMDStep(nn.Module):
    """One key of a speculative build: target shard + whole draft + four aliased caches; runs `role`."""

    def __init__(self, target: LlamaModel, draft: LlamaModel, layout: SpecCacheLayout, role: str, attend: int,
                 k: int, lnc: int):
        super().__init__()
        self.step, self.draft = BucketStep(target, attend), draft  # weights: step.model.*, draft.*
        self.role, self.k, self.lnc = role, k, lnc
        self.k_cache, self.v_cache = _cache_param(layout.target), _cache_param(layout.target)
        self.draft_k_cache, self.draft_v_cache = _cache_param(layout.draft), _cache_param(layout.draft)

    def aliases(self) -> dict:
        return {self.k_cache: K_OUT, self.v_cache: V_OUT, self.draft_k_cache: DK_OUT, self.draft_v_cache: DV_OUT}

    def forward(self, *args):
        k, v = self.k_cache.clone(), self.v_cache.clone()  # [L, N, Hkv, bs, D] target shard
        dk, dv = self.draft_k_cache.clone(), self.draft_v_cache.clone()  # [Ld, N, Hkv_d, bs, D_d] whole draft
        s = self.step.attend_len
        with neuron_target(lnc=self.lnc):
            if self.role == "target":  # ids, positions, logit_index, attend_rows, role, block_table [B, S/bs]
                ids, pos, idx, _, _, table = args
                out = self.step(ids, pos, k, v, idx, table)  # [B, n, V]
            elif self.role == "draft":
                ids, pos, idx, _, _, table = args
                out = self.draft(ids, pos, dk, dv, idx, s, table)  # [B, n, V]
            else:  # fused: ids2 [B, 2], pos2 [B, 2], uniforms [B, 3K+1], params [3], attend_rows, role, table
                ids2, pos2, u, params, _, _, table = args

                def run_draft(ids, pos, li):
                    return self.draft(ids, pos, dk, dv, li, s, table)

                def run_target(ids, pos, li):
                    return self.step.model(ids, pos, k, v, li, s, table)

                out = speculate(run_draft, run_target, ids2, pos2, self.k, u, params,
                                self.role == "fused_sample")  # [B, K+5]
        return out, k, v, dk, dv


@dataclass(frozen=True)
class SpecStepFactory:
    """`module_cls` of one key of a speculative build (uninitialized weights; values come with initialize)."""

    target: StepFactory  # the target shard's factory of the same bucket
    draft_model: dict  # the draft's ModelConfig
    draft_quant: str  # its quantization scheme ("none" when float)
    role: str
    k: int

    def __call__(self) -> SpecSPMDStep:
        t = self.target
        target_step = t()  # an SPMDStep of this bucket (imports NxD): the target shard, materialized as without a draft
        build = BuildConfig.from_dict(t.build)
        draft = draft_skeleton(ModelConfig.from_dict(self.draft_model), build, self.draft_quant)
        tcache = rank_cache(ModelConfig.from_dict(t.model), build, ShardPlan.from_dict(t.plan))
        layout = SpecCacheLayout(tcache, draft_cache(draft.cfg, build, 1))
        module = SpecSPMDStep(target_step.step.model, draft, layout, self.role, t.attend, self.k, t.lnc)
        draft.to_empty(device="cpu")
        for name in ("k_cache", "v_cache", "draft_k_cache", "draft_v_cache"):
            setattr(module, name, nn.Parameter(torch.empty_like(getattr(module, name), device="cpu"),
                                               requires_grad=False))
        draft.tie_weights()
        draft.materialize_buffers()
        return module.eval()


def draft_skeleton(cfg: ModelConfig, build: BuildConfig, quant: str) -> LlamaModel:
    """The whole draft on the meta device with its quantized structure; plain ops: it runs no collectives."""
    draft = empty_model(cfg, build)
    if quant != "none":
        apply_quantization(draft, QuantConfig(scheme=quant), structure_only=True)
    return draft


def draft_cache(cfg: ModelConfig, build: BuildConfig, tp: int) -> DeviceCacheShape:
    """The draft's device cache on every rank: all of its KV heads, the target's blocks (`tp` counts the replicas
    in nbytes)."""
    return DeviceCacheShape(cfg.num_layers, build.default_kv_blocks, cfg.num_kv_heads, build.block_size,
                            cfg.head_dim, cache_dtype(build), tp)


def role_tensor(role: str) -> torch.Tensor:
    return torch.zeros(ROLES[role], dtype=torch.int32)  # [r]: names the graph for NxD's routing


def graph_role(g: GraphSpec) -> str:
    if g.role == "fused":
        return "fused_sample" if g.sample else "fused_greedy"
    return "target" if g.role == "verify" else "draft"


def spec_example_args(build: BuildConfig, g: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Inputs of one key of a speculative build (see the module docstring)."""
    if g.role in ("context", "tokengen"):  # a plain target graph
        ids, pos, idx, attend, table = example_args(build, g)
        return (ids, pos, idx, attend, role_tensor("target"), table)
    role, b = graph_role(g), g.batch
    attend = torch.zeros(g.attend, dtype=torch.int32)  # [S]
    if g.role == "fused":
        ids2 = torch.zeros(b, 2, dtype=torch.int64)  # [B, 2]
        pos2 = torch.tensor([[0, 1]], dtype=torch.int64).expand(b, 2).contiguous()  # [B, 2]
        u = torch.full((b, uniforms_width(g.tokens)), 0.5, dtype=torch.float32)  # [B, 3K+1]
        params = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float32)  # [3]
        table = torch.zeros(b, g.attend // build.block_size, dtype=torch.int64)  # [B, S/bs]
        return ids2, pos2, u, params, attend, role_tensor(role), table
    ids, pos, idx, _, table = example_args(build, GraphSpec("x", g.tokens, g.attend, b))
    if g.role == "verify":  # logits at every token
        idx = torch.arange(g.tokens, dtype=torch.int64).expand(b, g.tokens).contiguous()  # [B, K+1]
    return (ids, pos, idx, attend, role_tensor(role), table)


def add_spec_keys(nxd: Any, builder: Any, build: BuildConfig, plan_graphs: list[GraphSpec], factory_of,
                  info: dict, compiler_args: str) -> list[str]:
    """Add every key of a speculative build (the plain target graphs and the speculation graphs) -> the graph
    records of the speculation graphs.
    `factory_of(attend)` -> the target StepFactory of that bucket; `info`: manifest speculation info."""
    k, draft_cfg, quant = build.speculation.length, info["config"], info["quant"]["scheme"]
    records = {}
    for g in spec_graph_list(build):
        factory = SpecStepFactory(factory_of(g.attend), draft_cfg, quant, graph_role(g), k)
        builder.add(key=g.name, model_instance=model_instance(nxd, factory),
                    example_inputs=[spec_example_args(build, g)], compiler_args=compiler_args)
        records[g.name] = {"kind": g.kind, "model": g.model, "tokens": g.tokens, "attend": g.attend, "batch": g.batch}
    for g in plan_graphs:  # the plain target graphs, as keys of the same speculative module
        factory = SpecStepFactory(factory_of(g.attend), draft_cfg, quant, "target", k)
        builder.add(key=g.name, model_instance=model_instance(nxd, factory),
                    example_inputs=[spec_example_args(build, g)], compiler_args=compiler_args)
    return records


def draft_rank_weights(root: Path, manifest, target: LlamaModel) -> dict[str, torch.Tensor]:
    """The draft's weights named as SpecSPMDStep parameters (the same on every rank)."""
    info = manifest.extra.speculation
    draft = draft_skeleton(info.config, manifest.build, info.quant["scheme"])
    load_draft_weights(draft, target, root / DRAFT_WEIGHTS, info.shared, manifest.build, info.quant["scheme"])
    return {f"draft.{k}": v for k, v in draft.state_dict().items()}


def device_spec_graphs(traced, build: BuildConfig, device_step) -> tuple[dict, dict]:
    """(draft engine graphs by core name, speculation graphs) over the NxD model."""
    dgraphs, sgraphs = {}, {}
    for g in spec_graph_list(build):
        role = graph_role(g)
        if g.role == "draft":
            dgraphs[g.name[len("draft_"):]] = device_step(traced, g.attend, role_tensor(role))
        elif g.role == "verify":
            sgraphs[g.name] = device_step(traced, g.attend, role_tensor(role))
        else:
            sgraphs[g.name] = _device_fused(traced, g.attend, role)
    return dgraphs, sgraphs


def _device_fused(traced, attend: int, role: str):
    attend_rows, marker = torch.zeros(attend, dtype=torch.int32), role_tensor(role)

    def run(ids2, pos2, k_flat, v_flat, uniforms, params, block_table):
        out = traced(ids2, pos2, uniforms, params, attend_rows, marker, block_table)
        return out[0] if isinstance(out, (list, tuple)) else out  # packed [B, K+5]; the caches stay aliased

    return run


@dataclass(frozen=True)
class DeviceSpecLayout(SpecCacheLayout):
    """Both caches live on the device (aliased state): the SpecEngine's flat host buffers are empty placeholders."""

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0, dtype=self.target.dtype), torch.empty(0, dtype=self.target.dtype)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat, flat
