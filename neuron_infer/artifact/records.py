"""The typed feature records of a manifest (`manifest.json` "extra"): quantization, tensor parallelism,
speculation, compile time. Parsed strictly like the rest of the manifest (neuron_infer.typed): a wrong value or an
unknown key is named."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from neuron_infer.config import ModelConfig


@dataclass(frozen=True)
class SpeculationRecord:
    """What the compile recorded of its speculation: the draft (or prompt lookup) and its graphs."""

    source: str  # a draft checkpoint directory, "self(layers=..., quant=...)" or "ngram"
    length: int  # K, tokens drafted per step
    fused: bool  # --fused-speculation
    graphs: list[str]  # the speculation graphs' names
    config: ModelConfig | None = None  # the draft model (None: prompt lookup)
    quant: dict[str, Any] | None = None  # the draft's quantization report
    shared: list[str] | None = None  # draft tensors taken from the target's weights (stored once)
    ngram_size: int | None = None  # prompt lookup


@dataclass(frozen=True)
class RankWeights:
    rank: int
    bytes: int
    replicated_bytes: int
    sharded_bytes: int


@dataclass(frozen=True)
class ManifestExtra:
    """Feature records; the tp_* ones only at tp > 1."""

    quant: dict[str, Any]  # the quantization report (per rank at tp > 1, under "per_rank")
    compile_seconds: float = 0.0
    speculation: SpeculationRecord | None = None
    tp_plan: dict[str, Any] | None = None  # ShardPlan.to_dict()
    tp_rank_weights: list[RankWeights] | None = None
    tp_backend_note: str | None = None  # how the ranks run their graphs
    tp_full_sharded_bytes: int | None = None  # the sharded parameters' bytes at tp = 1 (the 1/tp yardstick)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: unset records are left out."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if "speculation" in out:
            out["speculation"] = {k: v for k, v in out["speculation"].items() if v is not None}
        return out
