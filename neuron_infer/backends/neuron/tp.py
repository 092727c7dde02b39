"""Tensor parallelism on Neuron through neuronx-distributed's ModelBuilder. NOT YET RUN ON HARDWARE.

Written against neuronx-distributed's ModelBuilder (`neuronx_distributed.trace.model_builder`, the builder
neuronx-distributed-inference compiles with) and exercised in CI through a recording test double
(tests/parallel/test_neuron_tp.py) that binds every call against the real signatures
(tests/compile/neuron_sdk_signatures.py). neuronx_distributed is imported lazily, only for --target neuron at tp > 1.

    compile: builder = ModelBuilder(router=None, tp_degree=tp, checkpoint_loader=..., compiler_workdir=...,
                                    logical_nc_config=lnc)
             builder.add(key=<graph>, model_instance=<rank step + KV aliases>, example_inputs=[<bucket args>],
                         compiler_args="... --lnc=N")                  # once per planned graph
             torch.jit.save(builder.trace(initialize_model_weights=False), graphs/nxd_model.pt)
    load:    traced = torch.jit.load(graphs/nxd_model.pt)
             traced.nxd_model.initialize([rank 0 weights, ..., rank tp-1 weights], torch.tensor([0], int32))
             traced(input_ids, positions, logit_index, attend_rows, block_table) -> logits

One traced model holds every bucket's NEFF; its weights are one set per rank, loaded once by `initialize` and
shared by all buckets (none is inlined into a NEFF), as NxDI does. The weights are the artifact's
`weights/rank{r}.safetensors` (our own sharding, `parallel/shard.py`), so ModelBuilder's own `shard_checkpoint`
is not used and its `checkpoint_loader` refuses to be called.

SPMD: ModelBuilder traces one module for all ranks, so every rank's graph must be identical and rank-specific
values must be weights. The plan's ranks differ only in their vocabulary range: the embedding's `start` becomes a
per-rank int64 weight; any other difference is refused before compiling.

KV cache: each rank's caches are parameters of the traced module that the step returns updated, declared to
ModelBuilder as input/output aliases {k_cache: 1, v_cache: 2} (as NxDI's DecoderModelInstance does for its
`past_key_values`). They are device state: allocated on the device at `initialize`, updated in place by every
bucket, never copied to or from the host (ModelBuilder traces with output_aliased_tensor=False, so a call
returns the logits only). The engine's host cache tensors are empty placeholders.

Routing: NxD picks the bucket whose example input shapes a call matches. Token-generation buckets share their
input shapes, so each graph takes an `attend_rows` tensor [S] (zeros, unused by the math) whose length names its
bucket, as NxDI's attention mask [B, S] does.

Rank r of the plan is NeuronCore r of the TP group (an LNC=2 trn2 "core" is two physical cores); the model's
collectives are NxD's mappings `reduce_from_tensor_model_parallel_region` (after o_proj/down_proj/embedding) and
`gather_from_tensor_model_parallel_region` (vocab logits along the last dim), NeuronLink collectives on device.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from neuron_infer.artifact.plan import GraphSpec, spec_graph_list
from neuron_infer.artifact.plan import example_args as single_example_args
from neuron_infer.artifact.weights import DTYPES, empty_model, quant_structure
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ArtifactError, BackendUnavailableError, ConfigError
from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.nki_neuron import neuron_target
from neuron_infer.model.op_tables import get_ops
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.rank import rank_layout

NEURON_TP_NOTE = ("neuron tensor parallelism through neuronx-distributed ModelBuilder: one NEFF per graph, one "
                  "weight set per rank shared by every bucket, KV caches aliased on the device; not yet run on "
                  "hardware")
INSTALL_HINT = (
    "--target neuron with --tp-degree > 1 needs neuronx-distributed (with torch-neuronx and neuronx-cc) from the "
    "Neuron pip repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "neuronx-distributed) on a Trn1/Inf2/Trn2/Trn3 instance; use --target cpu here."
)
NXD_MODEL = "nxd_model.pt"  # under graphs/
START = "step.model.model.embed_tokens.start"  # the per-rank vocabulary start, a weight of the SPMD graph
K_OUT, V_OUT = 1, 2  # output indices of the updated caches (aliased to the cache parameters)


def import_nxd() -> Any:
    """Return the neuronx_distributed module, or raise one clear sentence when it is absent or a placeholder."""
    try:
        nxd = importlib.import_module("neuronx_distributed")
        builder = importlib.import_module("neuronx_distributed.trace.model_builder")
    except ImportError as e:
        raise BackendUnavailableError(INSTALL_HINT) from e
    if not all(callable(getattr(builder, f, None)) for f in ("ModelBuilder", "BaseModelInstance")):
        raise BackendUnavailableError("the installed neuronx_distributed lacks trace.model_builder.ModelBuilder; "
                                      + INSTALL_HINT)
    return nxd


def nxd_ops(nxd: Any, kernels: str):
    """The op table of a Neuron rank: NxD's all-reduce and last-dim all-gather as the model's collectives."""
    m = nxd.parallel_layers.mappings
    return get_ops(kernels).with_collectives(m.reduce_from_tensor_model_parallel_region,
                                             m.gather_from_tensor_model_parallel_region)


class SPMDStep(torch.nn.Module):
    """One bucket step of any rank: the caches are parameters (device state), returned updated for aliasing."""

    def __init__(self, step: torch.nn.Module, cache: CacheShape, lnc: int):
        super().__init__()
        self.step, self.lnc = step, lnc
        shape = cache.dims  # [L, N, Hkv, bs, D]: the block count is fixed at compile time on the device
        self.k_cache = torch.nn.Parameter(torch.empty(shape, dtype=cache.dtype, device="meta"), requires_grad=False)
        self.v_cache = torch.nn.Parameter(torch.empty(shape, dtype=cache.dtype, device="meta"), requires_grad=False)

    def aliases(self) -> dict:
        return {self.k_cache: K_OUT, self.v_cache: V_OUT}

    def forward(self, input_ids, positions, logit_index, attend_rows, block_table):
        del attend_rows  # [S]: names the bucket for NxD's shape routing
        k, v = self.k_cache.clone(), self.v_cache.clone()  # [L, N, Hkv, bs, D]
        with neuron_target(lnc=self.lnc):  # kernels="nki": the SDK's nki.jit with the compiled LNC grid
            logits = self.step(input_ids, positions, k, v, logit_index, block_table)  # [B, n, V]
        return logits, k, v


def _start_as_weight(model) -> None:
    """The embedding's vocabulary start (a Python int per rank) as an int64 weight, so one graph serves all ranks."""
    emb = model.model.embed_tokens
    if emb.sharded:
        del emb.start
        emb.start = torch.nn.Parameter(torch.zeros((), dtype=torch.int64, device="meta"), requires_grad=False)


@dataclass(frozen=True)
class StepFactory:
    """`module_cls` of a ModelBuilder model instance: the SPMD step of one planned graph (uninitialized weights)."""

    model: dict
    build: dict
    plan: dict
    attend: int
    lnc: int

    def __call__(self) -> SPMDStep:
        nxd = import_nxd()
        cfg, build = ModelConfig.from_dict(self.model), BuildConfig.from_dict(self.build)
        plan = ShardPlan.from_dict(self.plan)
        model = empty_model(cfg, build, rank_layout(plan.ranks[0]), nxd_ops(nxd, build.kernels))
        quant_structure(model, build)
        _start_as_weight(model)
        module = SPMDStep(BucketStep(model, self.attend), rank_cache(cfg, build, plan), self.lnc)
        module.to_empty(device="cpu")  # host tensors to trace with; the values arrive with nxd_model.initialize
        model.tie_weights()
        model.materialize_buffers()  # RoPE tables and head maps: graph constants, equal on every rank
        return module.eval()


def model_instance(nxd: Any, factory: StepFactory) -> Any:
    """A ModelBuilder model instance whose `get` declares the cache aliases (NxDI: DecoderModelInstance.get)."""
    base = nxd.trace.model_builder.BaseModelInstance

    class CacheAliasedInstance(base):
        def get(self, bucket_rank, **kwargs):
            return self.module, self.module.aliases()

    return CacheAliasedInstance(module_cls=factory, input_output_aliases={})


@dataclass(frozen=True)
class DeviceCacheShape(CacheShape):
    """Per-rank caches live on the device (aliased state); the engine holds empty placeholders."""

    tp: int = 1

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0, dtype=self.dtype), torch.empty(0, dtype=self.dtype)

    def nbytes(self) -> int:
        return self.tp * super().nbytes()  # device bytes over all ranks


def cache_dtype(build: BuildConfig) -> torch.dtype:
    return torch.float8_e4m3fn if build.quant.kv_cache_dtype == "fp8" else DTYPES[build.dtype]


def rank_cache(cfg: ModelConfig, build: BuildConfig, plan: ShardPlan) -> DeviceCacheShape:
    return DeviceCacheShape(cfg.num_layers, build.default_kv_blocks, plan.local_num_kv_heads, build.block_size,
                            cfg.head_dim, cache_dtype(build), plan.tp)


def example_args(build: BuildConfig, spec) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, logit_index, attend_rows [S], block_table [B, S/bs]) of one planned graph."""
    ids, pos, _, _, idx, table = single_example_args(CacheShape(1, 2, 1, build.block_size, 1, torch.float32), spec)
    return (ids, pos, idx, torch.zeros(spec.attend, dtype=torch.int32), table)


def check_spmd(plan: ShardPlan) -> None:
    """One traced graph serves every rank: ranks may differ only in their vocabulary start (a weight)."""
    shapes = [{k: v for k, v in r.local_layout_fields().items() if k != "vocab_start"} for r in plan.ranks]
    if any(s != shapes[0] for s in shapes[1:]):
        raise ConfigError(f"--tp-degree {plan.tp}: the ranks of this plan have different head/MLP shapes, which "
                          "one neuronx-distributed SPMD graph cannot serve; choose a tp degree that divides the "
                          "heads, KV heads and intermediate size evenly")


def no_checkpoint_loader() -> dict:
    raise ArtifactError("neuron-infer shards the weights itself (weights/rank{r}.safetensors); ModelBuilder's "
                        "checkpoint_loader is not used")


def verify_example_args(build: BuildConfig, tokens: int, attend: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, logit_index [B, T]: every token, attend_rows [S], block_table [B, S/bs]) of a
    verify graph."""
    ids, pos, _, rows, table = example_args(build, GraphSpec("verify", tokens, attend, build.batch_size))
    idx = torch.arange(tokens, dtype=torch.int64).expand(build.batch_size, tokens).contiguous()  # [B, T]
    return ids, pos, idx, rows, table


def add_verify_keys(nxd: Any, builder: Any, build: BuildConfig, factory_of, flags: str) -> dict:
    """Prompt lookup's verify graphs (no draft: plain SPMDStep keys) -> their graph records."""
    records = {}
    for g in spec_graph_list(build, draft=False):
        builder.add(key=g.name, model_instance=model_instance(nxd, factory_of(g.attend)),
                    example_inputs=[verify_example_args(build, g.tokens, g.attend)], compiler_args=flags)
        records[g.name] = {"kind": "verify", "tokens": g.tokens, "attend": g.attend, "batch": g.batch}
    return records


def has_draft(build: BuildConfig) -> bool:
    return build.speculation is not None and not build.speculation.is_ngram


def device_step(traced, attend: int, role: torch.Tensor | None = None):
    """The engine's step signature over the NxD model: the host caches are placeholders (the device holds them).
    `role`: the graph's role tensor in a speculative build (neuron_tp_spec.py)."""
    attend_rows = torch.zeros(attend, dtype=torch.int32)
    marker = () if role is None else (role,)

    def run(input_ids, positions, k_cache, v_cache, logit_index, block_table):
        out = traced(input_ids, positions, logit_index, attend_rows, *marker, block_table)
        return out[0] if isinstance(out, (list, tuple)) else out  # logits [B, n, V]; the caches stay aliased

    return run


verify_step = device_step  # a verify graph has a step's signature (logit_index names every token)
