"""One speculative step (K draft tokens, one target pass over K+1 positions, acceptance), written once.

`speculate` takes two callables (run the draft on T tokens, run the target on K+1 tokens), so the same code is
* the fused graph: `FusedSpecStep` binds them to the two models and both KV caches, and one compiled graph per
  tokengen bucket holds the K draft steps, the target pass and the acceptance;
* the unfused host loop: `SpecEngine` binds them to separately compiled draft and verify graphs.

Step protocol (per batch row; p = position where the newest token `last` is written, `prev` the token before it):

    draft pass 1   tokens [prev, last] at [p-1, p]  (T=2: rewriting slot p-1 with the token already there is
                                                     harmless, and it fills the slot the previous step could not
                                                     write when all K drafts were accepted)
    draft pass i   token d_{i-1} at p+i-1, i = 2..K (T=1)      -> d_1..d_K (argmax, or sampled from q)
    target pass    [last, d_1..d_K] at p..p+K                 -> logits at the K+1 positions
    acceptance     greedy_verify / speculative_verify         -> tokens [B, K+1] (PAD after), counts [B]

Stale cache slots past the accepted length are never visible: the next step writes its own positions before
attending, and attention only sees slots <= each token's position. So both caches stay consistent after a rejection
without any rollback.

Both models' caches live in one flat buffer per K and V (`SpecCacheLayout`), so the fused graph has the engine's
step signature (ids, positions, k_cache, v_cache, ...) and compiles through any backend unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.model.sampling import processed_probs, sample_from_probs
from neuron_infer.model.verify import greedy_verify, speculative_verify

RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, pos, logit_index) -> logits
# (the block table [B, S/bs] is bound into each RunFn: target and draft caches use the same block numbers)


def uniforms_width(k: int) -> int:
    """Uniforms per row per step: K draft samples, K acceptance tests, K+1 resample/bonus draws."""
    return 3 * k + 1


def packed_width(k: int) -> int:
    """Columns of a step's packed output: tokens (K+1), count, next position, next last, next prev."""
    return k + 5


@dataclass(frozen=True)
class SpecCacheLayout:
    """Target and draft KV caches as two views into one flat buffer (per K and per V). Both have the same blocks
    (count and size), so one block table addresses both."""

    target: CacheShape
    draft: CacheShape

    def __post_init__(self) -> None:
        t, d = self.target, self.draft
        if t.dtype != d.dtype or t.blocks != d.blocks or t.block_size != d.block_size:
            raise ValueError(f"target and draft caches must share dtype and blocks: {t} vs {d}")

    @staticmethod
    def _numel(c: CacheShape) -> int:
        return math.prod(c.dims)

    @staticmethod
    def _dims(c: CacheShape) -> tuple[int, ...]:
        return c.dims  # [L, N, Hkv, bs, D]

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._numel(self.target) + self._numel(self.draft)
        return torch.zeros(n, dtype=self.target.dtype), torch.zeros(n, dtype=self.target.dtype)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flat -> (target cache [L, N, Hkv, bs, D], draft cache [Ld, N, Hkv_d, bs, D_d]), sharing storage."""
        nt = self._numel(self.target)
        t = flat[:nt].view(self._dims(self.target))  # [L, N, Hkv, bs, D]
        d = flat[nt: nt + self._numel(self.draft)].view(self._dims(self.draft))  # [Ld, N, Hkv_d, bs, D_d]
        return t, d


def _propose(run_draft: RunFn, ids2, pos2, k: int, u, params, sample: bool):
    """K draft passes -> draft tokens [B, K] and (when sampling) their distributions q [B, K, V]."""
    b = ids2.shape[0]
    one = torch.ones(b, 1, dtype=torch.int64, device=ids2.device)  # [B, 1]: logits of `last` (index 1 of 2)
    zero = torch.zeros_like(one)  # [B, 1]
    logits = run_draft(ids2, pos2, one)[:, 0]  # [B, V]
    drafts, qs = [], []
    for i in range(k):
        if sample:
            q = processed_probs(logits, params)  # [B, V]
            d = sample_from_probs(q, u[:, i])  # [B]
            qs.append(q)
        else:
            d = logits.argmax(-1)  # [B]
        drafts.append(d)
        if i + 1 < k:
            logits = run_draft(d.view(b, 1), pos2[:, 1:] + (i + 1), zero)[:, 0]  # [B, V]
    draft = torch.stack(drafts, dim=1)  # [B, K]
    return draft, (torch.stack(qs, dim=1) if sample else None)  # q [B, K, V]


def speculate(run_draft: RunFn, run_target: RunFn, ids2: torch.Tensor, pos2: torch.Tensor, k: int,
              u: torch.Tensor, params: torch.Tensor, sample: bool) -> torch.Tensor:
    """One speculative step. ids2/pos2 [B, 2] = (prev, last) and their positions; u [B, 3K+1] uniforms; params [3]
    sampling parameters (ignored when greedy) -> packed [B, K+5] int64 (see `unpack`)."""
    b = ids2.shape[0]
    draft, q = _propose(run_draft, ids2, pos2, k, u, params, sample)
    ids = torch.cat([ids2[:, 1:], draft], dim=1)  # [B, K+1]: last, d_1..d_K
    steps = torch.arange(k + 1, dtype=torch.int64, device=ids2.device)  # [K+1]
    pos = pos2[:, 1:] + steps  # [B, K+1]
    logits = run_target(ids, pos, steps.expand(b, k + 1))  # [B, K+1, V]
    if sample:
        p = processed_probs(logits, params)  # [B, K+1, V]
        tokens, counts = speculative_verify(draft, q, p, u[:, k: 2 * k], u[:, 2 * k:])
    else:
        tokens, counts = greedy_verify(draft, logits)
    last = torch.gather(tokens, 1, (counts - 1).unsqueeze(1))  # [B, 1]
    before = torch.gather(tokens, 1, (counts - 2).clamp(min=0).unsqueeze(1))  # [B, 1]
    prev = torch.where(counts.unsqueeze(1) >= 2, before, ids2[:, 1:])  # [B, 1]
    next_pos = pos2[:, 1:] + counts.unsqueeze(1)  # [B, 1]
    return torch.cat([tokens, counts.unsqueeze(1), next_pos, last, prev], dim=1)  # [B, K+5]


def unpack(packed: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """packed [B, K+5] -> tokens [B, K+1] (PAD after count), counts [B], next_pos [B], next_last [B], next_prev [B]."""
    return {"tokens": packed[:, : k + 1], "counts": packed[:, k + 1], "next_pos": packed[:, k + 2],
            "next_last": packed[:, k + 3], "next_prev": packed[:, k + 4]}


class FusedSpecStep(nn.Module):
    """The fused-speculation graph of one tokengen bucket: K draft steps + one target pass + acceptance.

    forward(ids2 [B, 2], pos2 [B, 2], k_flat [F], v_flat [F], uniforms [B, 3K+1] fp32, params [3] fp32,
            block_table [B, S/bs]) -> packed [B, K+5] int64; both caches (views of k_flat / v_flat, of the block
            count compiled in) are updated in place.
    `sample=False` compiles the greedy rule (uniforms and params unused); `sample=True` the lossless sampling rule
    with the sampling parameters as an input, so one graph serves every temperature / top-k / top-p.
    """

    def __init__(self, target: nn.Module, draft: nn.Module, k: int, attend_len: int, layout: SpecCacheLayout,
                 sample: bool):
        super().__init__()
        self.target, self.draft = target, draft
        self.k, self.attend_len, self.layout, self.sample = k, attend_len, layout, sample

    def forward(self, ids2, pos2, k_flat, v_flat, uniforms, params, block_table):
        tk, dk = self.layout.views(k_flat)
        tv, dv = self.layout.views(v_flat)
        s = self.attend_len

        def run_draft(ids, pos, li):
            return self.draft(ids, pos, dk, dv, li, s, block_table)

        def run_target(ids, pos, li):
            return self.target(ids, pos, tk, tv, li, s, block_table)

        return speculate(run_draft, run_target, ids2, pos2, self.k, uniforms, params, self.sample)


def fused_example_args(layout: SpecCacheLayout, k: int, batch: int, attend: int) -> tuple[torch.Tensor, ...]:
    """Static-shape example inputs of a fused graph."""
    b = batch
    kf, vf = layout.allocate()
    ids2 = torch.zeros(b, 2, dtype=torch.int64)  # [B, 2]
    pos2 = torch.tensor([[0, 1]], dtype=torch.int64).expand(b, 2).contiguous()  # [B, 2]
    u = torch.full((b, uniforms_width(k)), 0.5, dtype=torch.float32)  # [B, 3K+1]
    params = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float32)  # [3]
    table = torch.zeros(b, attend // layout.target.block_size, dtype=torch.int64)  # [B, S/bs]
    return ids2, pos2, kf, vf, u, params, table
