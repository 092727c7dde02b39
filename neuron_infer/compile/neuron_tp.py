"""Tensor parallelism on Neuron through neuronx-distributed. NOT YET RUN ON HARDWARE.

Written against neuronx-distributed's documented inference API ("Inference APIs": parallel_model_trace /
parallel_model_save / parallel_model_load) and exercised in CI through a recording test double
(tests/parallel/test_neuron_tp.py). neuronx_distributed is imported lazily, only for --target neuron at tp > 1.

    compile: per (sub-model, bucket) graph
        parallel_model_trace(RankStepFactory(...), example_args, compiler_workdir=..., compiler_args=[...],
                             tp_degree=tp)      # tp workers; worker r calls the factory and traces rank r's step
        parallel_model_save(traced, graphs/<graph>)
    load:   parallel_model_load(graphs/<graph>) -> one callable that runs every rank's NEFF

How ranks map to NeuronCores: rank r of the plan is NeuronCore r of the TP group (an LNC=2 trn2 "core" is two
physical cores). Each worker builds rank r's model from the artifact's weights/rank{r}.safetensors with the same
`LocalLayout` as on CPU, and binds the model's collectives to NxD's mappings: `reduce_from_tensor_model_parallel_region`
(all-reduce after o_proj/down_proj/embedding) and `gather_from_tensor_model_parallel_region` (vocab logits all-gather
along the last dim) - on device these run over NeuronLink instead of gloo.

KV cache: a traced graph cannot mutate its inputs, and every rank receives the same inputs, so the step takes the
stacked caches of all ranks [tp, L, B, Hkv_local, S, D]; rank r updates its slice and the slices are all-gathered so
rank 0's output (what the TP model returns) holds every rank's cache, which the host copies back. That all-gather
moves the whole cache every step: correct, slow. On hardware the next step is neuronx-distributed's ModelBuilder with
the caches as per-rank device state (input_output_aliases), as NxDI does.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuron_infer.compile.neuron import COMPILER_ARGS, copy_back
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ArtifactError, BackendUnavailableError
from neuron_infer.model.nki_neuron import logical_nc_config, neuron_target
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.runtime.engine import CacheShape, planned_graphs

NEURON_TP_NOTE = ("neuron tensor parallelism through neuronx-distributed parallel_model_trace, one NEFF per rank per "
                  "graph; not yet run on hardware")
INSTALL_HINT = (
    "--target neuron with --tp-degree > 1 needs neuronx-distributed (with torch-neuronx and neuronx-cc) from the "
    "Neuron pip repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "neuronx-distributed) on a Trn1/Inf2/Trn2/Trn3 instance; use --target cpu here."
)


def import_nxd() -> Any:
    """Return the neuronx_distributed module, or raise one clear sentence when it is absent or a placeholder."""
    try:
        nxd = importlib.import_module("neuronx_distributed")
    except ImportError as e:
        raise BackendUnavailableError(INSTALL_HINT) from e
    trace = getattr(nxd, "trace", None)
    if not all(callable(getattr(trace, f, None)) for f in ("parallel_model_trace", "parallel_model_save",
                                                          "parallel_model_load")):
        raise BackendUnavailableError("the installed neuronx_distributed lacks trace.parallel_model_trace; "
                                      + INSTALL_HINT)
    return nxd


def nxd_ops(nxd: Any, kernels: str):
    """The op table of a Neuron rank: NxD's all-reduce and last-dim all-gather as the model's collectives."""
    from neuron_infer.model.ops import get_ops

    m = nxd.parallel_layers.mappings
    return get_ops(kernels).with_collectives(m.reduce_from_tensor_model_parallel_region,
                                             m.gather_from_tensor_model_parallel_region)


class TPRankStep(torch.nn.Module):
    """Rank r's bucket step in functional form over the stacked caches of all ranks (see the module docstring)."""

    def __init__(self, step: torch.nn.Module, rank: int, gather):
        super().__init__()
        self.step, self.rank, self.gather = step, rank, gather

    def forward(self, input_ids, positions, k_all, v_all, logit_index, *seq_ids):
        k, v = k_all[self.rank].clone(), v_all[self.rank].clone()  # [L, R, Hkv, S, D] this rank's cache
        with neuron_target():  # kernels="nki": the SDK's nki.jit inside the rank's graph (model/nki_neuron.py)
            logits = self.step(input_ids, positions, k, v, logit_index, *seq_ids)  # [B, n, V]
        k_all = self.gather(k.reshape(1, -1)).view(k_all.shape)  # [1, tp*N] -> [tp, L, R, Hkv, S, D]
        v_all = self.gather(v.reshape(1, -1)).view(v_all.shape)
        return logits, k_all, v_all


@dataclass(frozen=True)
class RankStepFactory:
    """Picklable `func` for parallel_model_trace: builds the calling worker's rank step from the artifact files."""

    root: str
    model: dict
    build: dict
    plan: dict
    attend: int
    select_rows: bool

    def __call__(self) -> tuple[torch.nn.Module, dict]:
        from neuron_infer.compile.quantize_step import quant_structure
        from neuron_infer.compile.weights import empty_model, load_rank_weights
        from neuron_infer.model.llama import BucketStep
        from neuron_infer.compile.tp import rank_layout

        nxd = import_nxd()
        rank = int(nxd.parallel_layers.parallel_state.get_tensor_model_parallel_rank())
        cfg, build = ModelConfig.from_dict(self.model), BuildConfig.from_dict(self.build)
        plan = ShardPlan.from_dict(self.plan)
        model = empty_model(cfg, build, rank_layout(plan.ranks[rank]), nxd_ops(nxd, build.kernels))
        quant_structure(model, build)
        load_rank_weights(model, Path(self.root) / "weights" / f"rank{rank}.safetensors")
        gather = nxd.parallel_layers.mappings.gather_from_tensor_model_parallel_region
        return TPRankStep(BucketStep(model, self.attend, self.select_rows), rank, gather).eval(), {}


@dataclass(frozen=True)
class StackedCacheShape(CacheShape):
    """All ranks' caches stacked: [tp, L, B, Hkv_local, S, D] (host copy of the per-rank device caches)."""

    tp: int = 1

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.tp, self.layers, self.batch, self.kv_heads, self.max_length, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    def nbytes(self) -> int:
        return self.tp * super().nbytes()


def example_args(cache: StackedCacheShape, spec) -> tuple[torch.Tensor, ...]:
    from neuron_infer.compile.builder import example_args as single

    k, v = cache.allocate()
    ids, pos, _, _, idx, *rest = single(CacheShape(1, 1, 1, 1, 1, cache.dtype), spec)
    return (ids, pos, k, v, idx, *rest)


def stacked_cache(cfg: ModelConfig, build: BuildConfig, plan: ShardPlan) -> StackedCacheShape:
    from neuron_infer.compile.weights import DTYPES

    dtype = torch.float8_e4m3fn if build.quant.kv_cache_dtype == "fp8" else DTYPES[build.dtype]
    return StackedCacheShape(cfg.num_layers, build.batch_size, plan.local_num_kv_heads, build.max_length,
                             cfg.head_dim, dtype, plan.tp)


def compile_neuron_tp_graphs(root: Path, cfg: ModelConfig, build: BuildConfig, plan: ShardPlan, say) -> dict:
    """Trace and save every planned graph over `plan.tp` NeuronCores (weights/rank{r} must already be in root)."""
    nxd = import_nxd()
    cache, graphs = stacked_cache(cfg, build, plan), {}
    # NKI kernels are launched with the LNC grid, which neuronx-cc's --lnc must match (EVRF066)
    lnc_args = [f"--lnc={logical_nc_config()}"] if build.kernels == "nki" else []
    for i, spec in enumerate(planned_graphs(build), 1):
        say(f"[{i}] neuronx-distributed: tracing {spec.name} over {plan.tp} NeuronCores")
        t0 = time.perf_counter()
        factory = RankStepFactory(str(root), cfg.to_dict(), build.to_dict(), plan.to_dict(), spec.attend,
                                  spec.select_rows)
        traced = nxd.trace.parallel_model_trace(factory, example_args(cache, spec),
                                                compiler_workdir=str(root / "graphs" / f"{spec.name}.workdir"),
                                                compiler_args=[*COMPILER_ARGS, *lnc_args], tp_degree=plan.tp)
        nxd.trace.parallel_model_save(traced, str(root / "graphs" / spec.name))
        graphs[spec.name] = {"kind": spec.kind, "tokens": spec.tokens, "attend": spec.attend, "batch": spec.batch,
                             "files": [spec.name], "seconds": round(time.perf_counter() - t0, 3)}
    return graphs


def load_neuron_tp_engine(root: Path, manifest, plan: ShardPlan):
    """An in-process Engine whose graphs run every rank on its NeuronCore (NxD drives the ranks)."""
    from neuron_infer.runtime.engine import Engine

    nxd = import_nxd()
    graphs = {}
    for spec in planned_graphs(manifest.build):
        try:
            traced = nxd.trace.parallel_model_load(str(root / "graphs" / spec.name))
        except (RuntimeError, OSError) as e:
            raise ArtifactError(f"cannot load Neuron TP graph {spec.name} from {root} ({e}); recompile") from e
        graphs[spec.name] = copy_back(traced)
    return Engine(graphs, manifest.build, stacked_cache(manifest.model, manifest.build, plan),
                  manifest.model.vocab_size)

