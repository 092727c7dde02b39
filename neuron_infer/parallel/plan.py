"""The tensor-parallel sharding plan: which heads, MLP rows and vocabulary rows each rank holds.

`ShardPlan.build(cfg, tp)` is a pure function of the model config and the degree. Every rank gets the same local
sizes (one compiled graph serves all ranks on Neuron), described by a `RankShard`:

    q_heads   global query-head id per local query slot; None = padding slot (zero q rows, zero o columns)
    kv_heads  global KV-head id per local KV slot (a KV head may live on several ranks: replication)
    q_to_kv   per local query slot, the index into `kv_heads` of the KV head it attends with

Head strategies (`ShardPlan.strategy`), chosen from H query heads, K KV heads (group g = H/K) and tp:

    kv_split      K % tp == 0: rank r holds K/tp whole KV heads and their H/tp query heads; nothing replicated.
    kv_replicate  tp > K: the vendor stack's "replicate to tp degree", one KV head per rank. KV head i is copied
                  to tp//K ranks (one more for the first tp % K heads) which split its g query heads; pieces are
                  padded to ceil(g / (tp//K)) slots (interleaved padding). Llama-3.1-8B at tp=32: 8 KV heads x4.
    contiguous    tp < K with K % tp != 0 (e.g. SmolLM2's 3 KV heads at tp=2), or whenever it needs fewer weights
                  per rank than kv_replicate: query heads are padded to a multiple of tp and dealt out in
                  contiguous, balanced blocks; each rank holds every KV head its block touches (KV heads on a block
                  boundary are replicated). A rank needing fewer KV heads than the uniform local count repeats its
                  last KV head in the spare slots; no query slot points there.
    The cheaper of kv_replicate / contiguous (query slots + KV slots per rank, then KV slots) is chosen.

    SmolLM2 (9 q / 3 kv, g = 3):
        tp = 2, contiguous:   rank 0: q [0 1 2 3 4] kv [0 1]    rank 1: q [5 6 7 8 -] kv [1 2]
        tp = 4, kv_replicate: rank 0: q [0 1 -] kv [0]   rank 1: q [2 - -] kv [0]
                              rank 2: q [3 4 5] kv [1]   rank 3: q [6 7 8] kv [2]          (- = padding slot)

MLP rows (gate/up output, down input) are split evenly (intermediate_size % tp must be 0). The vocabulary is padded
to a multiple of tp and split in contiguous ranges; padding rows are zero and their logits are dropped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuron_infer.config import ModelConfig
from neuron_infer.errors import ConfigError

# Two trn2.48xlarge at LNC=1 (2 x 128 NeuronCores). Beyond this a single tensor-parallel group is not sensible:
# per-rank matmuls become too thin to feed a 128x128 systolic array and collectives dominate.
MAX_TP_DEGREE = 256

STRATEGIES = ("kv_split", "kv_replicate", "contiguous")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RankShard:
    """What one rank holds. Field names match `neuron_infer.model.llama.LocalLayout` where they overlap."""

    rank: int
    q_heads: tuple[int | None, ...]
    kv_heads: tuple[int, ...]
    q_to_kv: tuple[int, ...]
    intermediate_range: tuple[int, int]  # [start, stop) of gate/up rows and down columns
    vocab_start: int  # first global token id of this rank's vocabulary range
    vocab_local: int  # rows held (uniform across ranks; rows past the real vocabulary are zero padding)
    vocab_size: int  # the true global vocabulary size

    @property
    def num_heads(self) -> int:
        """Local query-head slots, padding included."""
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def num_real_heads(self) -> int:
        return sum(h is not None for h in self.q_heads)

    @property
    def intermediate_size(self) -> int:
        return self.intermediate_range[1] - self.intermediate_range[0]

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of the real (unpadded) token ids this rank holds; may be empty for tiny vocabularies."""
        lo = min(self.vocab_start, self.vocab_size)
        return lo, min(self.vocab_start + self.vocab_local, self.vocab_size)

    def local_layout_fields(self) -> dict[str, Any]:
        """Keyword arguments for the model's `LocalLayout` (num_heads, num_kv_heads, q_to_kv, sizes, vocab)."""
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, q_to_kv=self.q_to_kv,
            intermediate_size=self.intermediate_size, vocab_start=self.vocab_start,
            vocab_local=self.vocab_local, vocab_size=self.vocab_size,
        )


@dataclass(frozen=True)
class ShardPlan:
    """Per-rank shards for one (model config, tp degree). Build with `ShardPlan.build`."""

    tp: int
    strategy: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    ranks: tuple[RankShard, ...]

    # ---- derived sizes ------------------------------------------------------------------------------------------
    @property
    def local_num_heads(self) -> int:
        return self.ranks[0].num_heads

    @property
    def local_num_kv_heads(self) -> int:
        return self.ranks[0].num_kv_heads

    @property
    def padded_num_heads(self) -> int:
        return self.local_num_heads * self.tp

    @property
    def local_vocab_size(self) -> int:
        return self.ranks[0].vocab_local

    @property
    def kv_replication(self) -> float:
        """Stored KV heads over real KV heads (1.0 = no replication)."""
        return self.local_num_kv_heads * self.tp / self.num_kv_heads

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, tp: int) -> ShardPlan:
        """The plan for `cfg` at degree `tp`; raises ConfigError (with the fix) for degrees it cannot express."""
        _validate_degree(cfg, tp)
        strategy, heads = choose_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        inter = cfg.intermediate_size // tp
        vocab_local = _ceil_div(cfg.vocab_size, tp)
        ranks = tuple(
            RankShard(
                rank=r, q_heads=q, kv_heads=kv, q_to_kv=q2kv,
                intermediate_range=(r * inter, (r + 1) * inter),
                vocab_start=r * vocab_local, vocab_local=vocab_local, vocab_size=cfg.vocab_size,
            )
            for r, (q, kv, q2kv) in enumerate(heads)
        )
        return cls(tp=tp, strategy=strategy, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                   ranks=ranks)

    # ---- JSON (manifest) ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ConfigError(f"shard plan keys {sorted(d)} differ from {sorted(names)}; recompile the artifact")
        ranks = tuple(
            RankShard(
                rank=int(r["rank"]), q_heads=tuple(r["q_heads"]), kv_heads=tuple(r["kv_heads"]),
                q_to_kv=tuple(r["q_to_kv"]), intermediate_range=tuple(r["intermediate_range"]),
                vocab_start=int(r["vocab_start"]), vocab_local=int(r["vocab_local"]), vocab_size=int(r["vocab_size"]),
            )
            for r in d["ranks"]
        )
        return cls(**{**dict(d), "ranks": ranks})

    def summary(self) -> str:
        """One line for logs and the capacity table."""
        pad = self.padded_num_heads - self.num_heads
        return (f"tp={self.tp} {self.strategy}: {self.local_num_heads} q heads/rank ({pad} padding), "
                f"{self.local_num_kv_heads} kv heads/rank (x{self.kv_replication:g} kv storage), "
                f"{self.intermediate_size // self.tp} MLP rows/rank, {self.local_vocab_size} vocab rows/rank")


# --------------------------------------------------------------------------------------------------------------
# head assignment


_Heads = tuple[tuple[int | None, ...], tuple[int, ...], tuple[int, ...]]


def _finish_rank(q: list[int | None], kv_needed: list[int], kv_slots: int, group: int) -> _Heads:
    """Pad a rank's KV list to `kv_slots` (repeating its last head) and map every query slot to its KV slot."""
    kv = list(kv_needed) + [kv_needed[-1]] * (kv_slots - len(kv_needed))
    q2kv = tuple(0 if h is None else kv.index(h // group) for h in q)
    return tuple(q), tuple(kv), q2kv


def _contiguous_heads(h: int, k: int, tp: int) -> list[_Heads]:
    """Balanced contiguous query blocks (padding at each block's end); each rank keeps the KV heads it touches."""
    group, slots = h // k, _ceil_div(h, tp)
    blocks, start = [], 0
    for r in range(tp):
        n = h // tp + (1 if r < h % tp else 0)
        blocks.append(list(range(start, start + n)) + [None] * (slots - n))
        start += n
    needed = [sorted({q // group for q in b if q is not None}) for b in blocks]
    kv_slots = max(len(n) for n in needed)
    return [_finish_rank(b, n, kv_slots, group) for b, n in zip(blocks, needed)]


def _replicated_heads(h: int, k: int, tp: int) -> list[_Heads]:
    """tp >= k, one KV head per rank: KV head i gets n_i = tp//k (+1 for the first tp % k heads) ranks, which
    split its query group in balanced contiguous pieces, each padded to ceil(g / (tp//k)) slots."""
    group = h // k
    copies = [tp // k + (1 if i < tp % k else 0) for i in range(k)]
    slots = _ceil_div(group, tp // k)
    out = []
    for kv, n_kv in enumerate(copies):
        for j in range(n_kv):
            lo = kv * group + j * (group // n_kv) + min(j, group % n_kv)
            n = group // n_kv + (1 if j < group % n_kv else 0)
            q: list[int | None] = list(range(lo, lo + n)) + [None] * (slots - n)
            out.append(_finish_rank(q, [kv], 1, group))
    return out


def _cost(heads: list[_Heads]) -> tuple[int, int]:
    """Per-rank weight units (q+o per query slot, k+v per KV slot), then KV slots (cache size) as tie-break."""
    q, kv, _ = heads[0]
    return len(q) + len(kv), len(kv)


def choose_heads(h: int, k: int, tp: int) -> tuple[str, list[_Heads]]:
    """The head strategy for (H, K, tp): see the module docstring. Pure; exposed for tests."""
    if k % tp == 0:
        return "kv_split", _contiguous_heads(h, k, tp)
    candidates = [("contiguous", _contiguous_heads(h, k, tp))]
    if tp >= k:  # the vendor strategy first, so it wins ties
        candidates.insert(0, ("kv_replicate", _replicated_heads(h, k, tp)))
    return min(candidates, key=lambda c: _cost(c[1]))


def _validate_degree(cfg: ModelConfig, tp: Any) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise ConfigError(f"tp degree {tp!r} must be an integer >= 1")
    if tp < 1:
        raise ConfigError(f"tp degree {tp} must be >= 1 (1 = no tensor parallelism)")
    if tp > MAX_TP_DEGREE:
        raise ConfigError(f"tp degree {tp} exceeds the supported maximum {MAX_TP_DEGREE}; use a smaller --tp-degree")
    if tp > cfg.num_heads:
        raise ConfigError(
            f"tp degree {tp} exceeds the model's {cfg.num_heads} query heads, so some ranks would hold only "
            f"padding; use --tp-degree <= {cfg.num_heads}"
        )
    if cfg.intermediate_size % tp:
        ok = [d for d in range(1, min(cfg.num_heads, MAX_TP_DEGREE) + 1) if cfg.intermediate_size % d == 0]
        raise ConfigError(
            f"tp degree {tp} does not divide intermediate_size={cfg.intermediate_size}, so the MLP cannot be split "
            f"evenly; use one of --tp-degree {ok}"
        )
