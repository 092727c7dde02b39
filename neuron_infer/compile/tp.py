"""The ranks of a compile (compile/builder.py runs one pipeline over them): at tp > 1 one weight file and one graph
directory per rank, the plan in the manifest.

    ARTIFACTS/
      weights/rank{r}.safetensors   rank r's shard only (shard_state_dict), quantized per rank when --quant is set
      graphs/rank{r}/...            rank r's step graphs (backend-specific files; none for cpu-eager)
      manifest.json                 backend, extra.tp_plan (ShardPlan.to_dict()), extra.tp_rank_weights

CPU: rank graphs run eagerly (backend "cpu-eager", recorded in the manifest). The model's collectives are eager
gloo calls (neuron_infer.parallel.launch) that count progress per rank, which is how a hung rank is named; a compiled
graph would hide them. (AOTInductor can compile torch's *functional* all_reduce over gloo on CPU, so compiled CPU
rank graphs are possible; they would have to be compiled inside a live process group.)

Quantization per rank: the compile quantization step (apply_quantization) runs on each rank's float shard. Column-parallel layers (q/k/v, gate/up,
lm_head) have per-output-channel scales identical to tp = 1 (each output row is whole on one rank). Row-parallel
layers (o_proj, down_proj) hold a slice of every output row, so per-channel (int8/fp8/w8a8) scales are computed from
that slice: the quantization is finer than at tp = 1, so quantized TP logits match quantized tp = 1 logits only
within the quantization error, not bit for bit. MX block scales run along the input dimension in blocks of 32 and are
identical to tp = 1 when each rank's input slice is a multiple of 32.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuron_infer.artifact.weights import DTYPES, build_float_model
from neuron_infer.backends import get_backend
from neuron_infer.backends.neuron.tp import NEURON_TP_NOTE, import_nxd
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.llama import LlamaModel
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.rank import rank_layout, tp_ops
from neuron_infer.parallel.shard import shard_state_dict

Progress = Callable[[str], None]

# The backend CPU rank graphs use, and why (also written to the manifest as extra.tp_backend_note).
CPU_TP_BACKEND = "cpu-eager"
CPU_TP_NOTE = ("tensor-parallel CPU ranks run their step graphs eagerly (cpu-eager): the gloo collectives between "
               "layers are eager calls that the launcher monitors per rank; compiled CPU rank graphs are not built")


def tp_backend_name(build: BuildConfig, backend: str | None) -> str:
    """The graph backend of a TP compile: CPU ranks always run eagerly (see the module docstring)."""
    name = backend or build.target
    if name in ("cpu", "cpu-eager"):
        return CPU_TP_BACKEND
    if name != "neuron":
        raise ConfigError(f"backend {name!r} cannot run tensor-parallel ranks; use --target cpu or --target neuron")
    return name


def _replicated(name: str) -> bool:
    return name.endswith("norm.weight")  # input/post-attention layernorms and the final norm


def rank_weight_record(model: LlamaModel, rank: int, nbytes: int) -> dict:
    """Bytes of one rank's file split into sharded parts and replicated norms."""
    state = model.state_dict()
    rep = sum(t.numel() * t.element_size() for k, t in state.items() if _replicated(k))
    return {"rank": rank, "bytes": nbytes, "replicated_bytes": rep, "sharded_bytes": nbytes - rep}


def full_sharded_bytes(cfg: ModelConfig, build: BuildConfig, state: dict[str, torch.Tensor]) -> int:
    """Bytes the sharded parameters take at tp = 1 in the build dtype (float; the yardstick for `1/tp`)."""
    elem = torch.empty((), dtype=DTYPES[build.dtype]).element_size()
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in state
    return sum(t.numel() * elem for k, t in state.items()
               if not _replicated(k) and not (tied_head and k == "lm_head.weight"))


def is_spec_graph(record: dict) -> bool:
    """A speculation graph's manifest record (the draft model's, a verify or a fused step)."""
    return record.get("model") == "draft" or record.get("kind") in ("verify", "fused")


def _merge_graphs(graphs: dict, rank_graphs: dict) -> dict:
    """Graph records keyed by name; per-rank files and compile seconds are listed in rank order."""
    for name, meta in rank_graphs.items():
        shared = ("kind", "model", "tokens", "attend", "batch")
        entry = graphs.setdefault(name, {k: meta[k] for k in shared if k in meta} | {"ranks": []})
        entry["ranks"].append({k: v for k, v in meta.items() if k not in shared})
    return graphs


@dataclass(frozen=True)
class RankSet:
    """The ranks of a compile: tp = 1 is one rank holding the whole model; tp > 1 the shard plan's ranks, whose
    graphs run eagerly on CPU or as one neuronx-distributed model on Neuron."""

    tp: int
    plan: ShardPlan | None  # None at tp = 1
    backend_name: str
    backend: Any  # the per-rank graph backend; None when neuronx-distributed compiles every rank at once
    nxd: bool

    @classmethod
    def of(cls, cfg: ModelConfig, build: BuildConfig, backend: str | None, say: Progress) -> RankSet:
        """The ranks of a build; unsupported combinations are refused here, before any work."""
        if build.tp_degree == 1:
            be = get_backend(backend or build.target)
            if hasattr(be, "bind_build"):  # neuron: the build's logical-NeuronCore degree (backends/neuron/platform.py)
                be.bind_build(build)
            return cls(1, None, be.name, be, False)
        plan = ShardPlan.build(cfg, build.tp_degree)  # rejects degrees the plan cannot express
        if build.quant.scheme == "w8a8":
            raise ConfigError("--quant w8a8 calibrates SmoothQuant scales on full-model activations, which a single "
                              "rank does not see; compile w8a8 at --tp-degree 1 (or use int8/fp8/mxfp8/mxfp4 with TP)")
        name = tp_backend_name(build, backend)
        if name == "neuron":
            import_nxd()  # fail before any work when neuronx-distributed is absent
        say(f"note: {NEURON_TP_NOTE if name == 'neuron' else CPU_TP_NOTE}")
        say(f"tensor parallelism: {plan.summary()}")
        return cls(plan.tp, plan, name, None if name == "neuron" else get_backend(name), name == "neuron")

    def float_model(self, cfg: ModelConfig, build: BuildConfig, state: dict[str, torch.Tensor],
                    rank: int) -> LlamaModel:
        """Rank `rank`'s float model from the full checkpoint state."""
        if self.plan is None:
            return build_float_model(cfg, build, state)
        mine = shard_state_dict(state, cfg, self.plan, rank)
        return build_float_model(cfg, build, mine, rank_layout(self.plan.ranks[rank]), tp_ops(build.kernels))

    def shareable(self, name: str) -> bool:
        """Tensors a draft may share with rank 0's model: all at tp = 1, the whole (replicated) norms otherwise."""
        return self.plan is None or _replicated(name)

    def graphs_dir(self, root: Path, rank: int) -> Path:
        return root / "graphs" if self.plan is None else root / "graphs" / f"rank{rank}"

    def rank_say(self, say: Progress, rank: int) -> Progress:
        return say if self.plan is None else (lambda m: say(f"rank {rank}: {m}"))

    def merge_graphs(self, graphs: dict, rank_graphs: dict) -> dict:
        return rank_graphs if self.plan is None else _merge_graphs(graphs, rank_graphs)

    def weight_record(self, model: LlamaModel, rank: int, nbytes: int) -> dict:
        return rank_weight_record(model, rank, nbytes)

    def quant_extra(self, build: BuildConfig, quant: list[dict], records: list[dict]) -> dict:
        """The manifest's quantization record (per rank at tp > 1) and, at tp > 1, the weight bytes per rank."""
        if self.plan is None:
            return {"quant": quant[0]}
        q = quant[0] if build.quant.scheme == "none" else {**quant[0], "per_rank": quant}
        return {"quant": q, "tp_rank_weights": records}

    def extra(self, cfg: ModelConfig, build: BuildConfig, state: dict[str, torch.Tensor]) -> dict:
        """The manifest records of tensor parallelism: the plan, the backend note, the unsharded yardstick."""
        if self.plan is None:
            return {}
        note = NEURON_TP_NOTE if self.nxd else CPU_TP_NOTE
        return {"tp_plan": self.plan.to_dict(), "tp_backend_note": note,
                "tp_full_sharded_bytes": full_sharded_bytes(cfg, build, state)}

    @property
    def times(self) -> str:
        return "" if self.plan is None else f" x {self.tp} ranks"

    def weights_note(self, extra: dict) -> str:
        if self.plan is None:
            return ""
        return f"({max(r['bytes'] for r in extra['tp_rank_weights']) / 2**20:.1f} MiB weights/rank) "
