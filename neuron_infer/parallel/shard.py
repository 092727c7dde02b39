"""Pure shard / gather functions, one per weight layout, with exact round trips: gather(shards) == full.

Layouts (all weights are torch `[out_features, in_features]`, biases `[out_features]`):

    q_heads     column-parallel by query heads: rows grouped [H, D]; padding slots get zero rows (and zero bias)
    kv_heads    column-parallel by KV heads: rows grouped [K, D]; replicated heads are copied to several ranks
    o_heads     row-parallel by query heads: columns grouped [H, D]; padding slots get zero columns
    column      column-parallel, even split of rows (gate/up weight and bias)
    row         row-parallel, even split of columns (down weight)
    row_bias    bias of a row-parallel layer (o_proj/down_proj): the full bias on rank 0, zeros elsewhere, so the
                all-reduce after the layer adds it exactly once and every rank runs the same nn.Linear
    vocab       vocab-parallel rows (embedding, lm_head): contiguous ranges, zero rows past the real vocabulary
    replicated  every rank holds the full tensor (norm weights)

`gather` is strict: it rejects padding that is not zero and replicas that differ, so a corrupted shard set fails
loudly instead of gathering into a plausible-looking tensor.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from neuron_infer.config import ModelConfig
from neuron_infer.errors import ConfigError
from neuron_infer.parallel.plan import ShardPlan

LAYOUT_KINDS = ("q_heads", "kv_heads", "o_heads", "column", "row", "row_bias", "vocab", "replicated")


@dataclass(frozen=True)
class Layout:
    """How one tensor is split. `heads[r]` = global head id per local slot of rank r (None = padding)."""

    kind: str
    tp: int
    head_dim: int = 0
    heads: tuple[tuple[int | None, ...], ...] = ()
    full_size: int = 0  # global size of the split dimension in rows/heads*head_dim/vocab (0 = not needed)

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ConfigError(f"layout kind {self.kind!r} is unknown; choose one of {', '.join(LAYOUT_KINDS)}")
        if self.kind in ("q_heads", "kv_heads", "o_heads") and len(self.heads) != self.tp:
            raise ConfigError(f"layout {self.kind} needs one head list per rank ({self.tp}), got {len(self.heads)}")


def plan_layout(plan: ShardPlan, kind: str) -> Layout:
    """The Layout of `kind` under `plan` (head lists and global sizes filled in)."""
    if kind in ("q_heads", "o_heads"):
        heads = tuple(r.q_heads for r in plan.ranks)
        return Layout(kind, plan.tp, plan.head_dim, heads, plan.num_heads * plan.head_dim)
    if kind == "kv_heads":
        heads = tuple(tuple(r.kv_heads) for r in plan.ranks)
        return Layout(kind, plan.tp, plan.head_dim, heads, plan.num_kv_heads * plan.head_dim)
    if kind in ("column", "row"):
        return Layout(kind, plan.tp, full_size=plan.intermediate_size)
    if kind == "vocab":
        return Layout(kind, plan.tp, full_size=plan.vocab_size)
    return Layout(kind, plan.tp)


# --------------------------------------------------------------------------------------------------------------
# shard


def shard(full: torch.Tensor, rank: int, tp: int, layout: Layout) -> torch.Tensor:
    """Rank `rank`'s piece of `full` (a new contiguous tensor; `full` is never modified)."""
    if layout.tp != tp or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} / tp {tp} does not match a layout built for tp={layout.tp}")
    kind = layout.kind
    if kind in ("q_heads", "kv_heads"):
        return _select_heads(full, 0, layout.heads[rank], layout.head_dim)
    if kind == "o_heads":
        return _select_heads(full, full.dim() - 1, layout.heads[rank], layout.head_dim)
    if kind in ("column", "row"):
        dim = 0 if kind == "column" else full.dim() - 1
        if full.shape[dim] % tp:
            raise ValueError(f"{kind} layout: size {full.shape[dim]} along dim {dim} is not divisible by tp={tp}")
        n = full.shape[dim] // tp
        return full.narrow(dim, rank * n, n).clone()
    if kind == "row_bias":
        return full.clone() if rank == 0 else torch.zeros_like(full)
    if kind == "vocab":
        return _vocab_rows(full, rank, tp)
    return full.clone()  # replicated


def _select_heads(full: torch.Tensor, dim: int, heads: Sequence[int | None], head_dim: int) -> torch.Tensor:
    """Pick head blocks of `head_dim` along `dim` in slot order; padding slots (None) are zero."""
    n_heads = full.shape[dim] // head_dim
    if full.shape[dim] != n_heads * head_dim:
        raise ValueError(f"size {full.shape[dim]} along dim {dim} is not a multiple of head_dim={head_dim}")
    grouped = full.unflatten(dim, (n_heads, head_dim))  # [..., n_heads, head_dim, ...] at dims (dim, dim+1)
    idx = torch.tensor([0 if h is None else h for h in heads], dtype=torch.long)
    out = grouped.index_select(dim, idx)  # [..., slots, head_dim, ...]
    pad = [i for i, h in enumerate(heads) if h is None]
    if pad:
        out.index_fill_(dim, torch.tensor(pad, dtype=torch.long), 0)
    return out.flatten(dim, dim + 1).contiguous()  # [..., slots*head_dim, ...]


def _vocab_rows(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    vocab = full.shape[0]
    local = -(-vocab // tp)
    lo, hi = min(rank * local, vocab), min((rank + 1) * local, vocab)
    out = full.new_zeros((local, *full.shape[1:]))  # [V_local, H]; rows past the vocabulary stay zero
    out[: hi - lo] = full[lo:hi]
    return out


# --------------------------------------------------------------------------------------------------------------
# gather


def gather(shards: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """Reassemble the full tensor from all ranks' shards (exact inverse of `shard`)."""
    if len(shards) != layout.tp:
        raise ValueError(f"gather needs {layout.tp} shards, got {len(shards)}")
    kind = layout.kind
    if kind in ("q_heads", "kv_heads", "o_heads"):
        dim = 0 if kind != "o_heads" else shards[0].dim() - 1
        return _gather_heads(shards, dim, layout)
    if kind == "column":
        return torch.cat(list(shards), dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=-1)
    if kind == "vocab":
        full = torch.cat(list(shards), dim=0)
        _check_zero(full[layout.full_size:], "vocab padding rows")
        return full[: layout.full_size].clone()
    for r, s in enumerate(shards[1:], start=1):
        if kind == "row_bias":
            _check_zero(s, f"row-parallel bias on rank {r}")
        elif not torch.equal(s, shards[0]):
            raise ValueError(f"replicated tensor differs between rank 0 and rank {r}")
    return shards[0].clone()


def _gather_heads(shards: Sequence[torch.Tensor], dim: int, layout: Layout) -> torch.Tensor:
    d = layout.head_dim
    n_heads = layout.full_size // d
    first = shards[0].unflatten(dim, (-1, d))  # [..., slots, D, ...]
    shape = list(first.shape)
    shape[dim] = n_heads
    out = first.new_zeros(shape)  # [..., n_heads, D, ...]
    seen: set[int] = set()
    for r, s in enumerate(shards):
        grouped = s.unflatten(dim, (-1, d))  # [..., slots, D, ...]
        for slot, h in enumerate(layout.heads[r]):
            block = grouped.select(dim, slot)
            if h is None:
                _check_zero(block, f"padding head slot {slot} on rank {r}")
            elif h in seen:
                if not torch.equal(out.select(dim, h), block):
                    raise ValueError(f"replicas of head {h} differ (rank {r}, slot {slot})")
            else:
                out.select(dim, h).copy_(block)
                seen.add(h)
    missing = sorted(set(range(n_heads)) - seen)
    if missing:
        raise ValueError(f"heads {missing} are held by no rank; the layout does not cover the tensor")
    return out.flatten(dim, dim + 1)  # [..., n_heads*D, ...]


def _check_zero(t: torch.Tensor, what: str) -> None:
    if t.numel() and bool(t.ne(0).any()):
        raise ValueError(f"{what} must be zero but holds non-zero values; the shards are corrupt or mixed")


# --------------------------------------------------------------------------------------------------------------
# state dicts

_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), k) for p, k in (
    (r"model\.embed_tokens\.weight", "vocab"),
    (r"lm_head\.weight", "vocab"),
    (r"model\.norm\.weight", "replicated"),
    (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "replicated"),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", "q_heads"),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)", "kv_heads"),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", "o_heads"),
    (r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.bias", "row_bias"),
    (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj)\.(weight|bias)", "column"),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", "row"),
))


def layout_kind(name: str) -> str:
    """The layout kind of a Hugging Face Llama parameter name; unknown names raise (strict loading)."""
    for pattern, kind in _RULES:
        if pattern.fullmatch(name):
            return kind
    raise ConfigError(
        f"parameter {name!r} has no tensor-parallel layout; neuron-infer shards Hugging Face Llama names only "
        "(is this checkpoint a Llama-family model?)"
    )


def shard_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, plan: ShardPlan,
                     rank: int) -> dict[str, torch.Tensor]:
    """That rank's state dict: every tensor replaced by its shard (new tensors; `sd` is untouched).

    With tied embeddings `lm_head.weight` is dropped (as Hugging Face files omit it): the model ties its lm_head
    to the embedding shard, so the rank file holds the vocabulary rows once."""
    _check_plan(cfg, plan)
    if cfg.tie_word_embeddings and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
            raise ConfigError("tie_word_embeddings is true but lm_head.weight differs from the embedding; fix "
                              "config.json (tie_word_embeddings: false) or the checkpoint")
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    layouts = {k: plan_layout(plan, k) for k in LAYOUT_KINDS}
    return {name: shard(t, rank, plan.tp, layouts[layout_kind(name)]) for name, t in sd.items()}


def gather_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]], cfg: ModelConfig,
                       plan: ShardPlan) -> dict[str, torch.Tensor]:
    """Inverse of `shard_state_dict` over all ranks (for tests, export and debugging)."""
    _check_plan(cfg, plan)
    names = list(shards[0])
    for r, s in enumerate(shards):
        if list(s) != names:
            raise ValueError(f"rank {r} holds parameters {sorted(set(s) ^ set(names))} that rank 0 does not (or v.v.)")
    layouts = {k: plan_layout(plan, k) for k in LAYOUT_KINDS}
    return {n: gather([s[n] for s in shards], layouts[layout_kind(n)]) for n in names}


def rank_weight_bytes(sd: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a (rank's) state dict, counting tensors that share storage (tied embeddings) once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in sd.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _check_plan(cfg: ModelConfig, plan: ShardPlan) -> None:
    ours = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    theirs = (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.intermediate_size, plan.vocab_size)
    if ours != theirs:
        raise ConfigError(f"the shard plan was built for another model (heads/kv/head_dim/inter/vocab {theirs} != "
                          f"{ours}); rebuild it with ShardPlan.build(cfg, tp)")


def rank_param_counts(cfg: ModelConfig, plan: ShardPlan) -> dict[str, int]:
    """Elements each rank stores, by group (every rank stores the same shapes). `lm_head` is 0 when tied."""
    hid, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q, kv, inter = plan.local_num_heads * d, plan.local_num_kv_heads * d, plan.intermediate_size // plan.tp
    attn = hid * q * 2 + hid * kv * 2  # q_proj + o_proj, k_proj + v_proj
    if cfg.attention_bias:
        attn += q + 2 * kv + hid  # o_proj's bias is full-size on every rank (zeros off rank 0)
    mlp = 3 * hid * inter + ((2 * inter + hid) if cfg.mlp_bias else 0)
    vocab_rows = plan.local_vocab_size * hid
    return {
        "attention": layers * attn,
        "mlp": layers * mlp,
        "norms": (2 * layers + 1) * hid,
        "embedding": vocab_rows,
        "lm_head": 0 if cfg.tie_word_embeddings else vocab_rows,
    }
