"""Speculative-decoding verification rules, as pure tensor functions (graph-friendly, batched, reproducible).

A draft proposes K tokens d_1..d_K for each batch row; the target scores the K+1 positions [last, d_1..d_K] in one
pass. These functions decide, per row, how many drafted tokens are accepted and which token follows them:

* greedy   — accept the longest prefix where d_i == argmax(target_i), then emit the target's own token there
             (the correction, or the bonus token when all K match). Identical to target-only greedy decoding.
* sampling — lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
             min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from normalize(max(p_i - q_i, 0)); when all K
             are accepted, sample the bonus token from p_K. The emitted tokens are distributed exactly as if the
             target had sampled them one at a time from p.

All randomness comes from explicit uniform tensors (one per draft token, per acceptance test, per resample), so the
same rule runs inside a compiled graph and on the host, and a seeded run is reproducible. No data-dependent Python
branches: every row computes every candidate and `counts` selects.

Output convention (both rules): tokens [B, K+1] int64 with the emitted tokens first and PAD (-1) after them,
counts [B] int64 in 1..K+1 (accepted drafts + the one target token).
"""
from __future__ import annotations

import torch

from neuron_infer.model.sampling import sample_from_probs

PAD = -1


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] bool -> number of leading True values per row [B] int64."""
    return torch.cumprod(accept.to(torch.int64), dim=-1).sum(-1)


def _pad_after(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep tokens[b, :counts[b]], PAD the rest. tokens [B, K+1], counts [B]."""
    col = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, K+1]
    return torch.where(col < counts.unsqueeze(1), tokens, torch.full_like(tokens, PAD))


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, K] ids, target_logits [B, K+1, V] -> (tokens [B, K+1] PAD-padded, counts [B]).

    The emitted tokens are the target's argmax at each position up to and including the first mismatch (on the
    accepted prefix they equal the draft tokens), so the output is target-only greedy by construction.
    """
    return greedy_accept(draft, target_logits.argmax(-1))


def greedy_accept(draft: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_verify from the target's argmax ids: draft [B, K], best [B, K+1] -> (tokens [B, K+1], counts [B])."""
    n_acc = accepted_prefix(draft == best[:, :-1])  # [B]
    counts = n_acc + 1
    return _pad_after(best, counts), counts


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) over the last axis; where p == q (nothing left) fall back to p.

    The fallback is never sampled in exact arithmetic: if p == q every draft token is accepted (p/q = 1).
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), p)


def speculative_verify(
    draft: torch.Tensor,  # [B, K] int64 drafted tokens (d_i ~ q_i)
    q: torch.Tensor,  # [B, K, V] draft probabilities each d_i was sampled from (processed)
    p: torch.Tensor,  # [B, K+1, V] target probabilities at the K+1 positions (processed identically)
    u_accept: torch.Tensor,  # [B, K] uniforms in [0, 1) for the acceptance tests
    u_sample: torch.Tensor,  # [B, K+1] uniforms in [0, 1) for the resample / bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling -> (tokens [B, K+1] PAD-padded, counts [B])."""
    k = draft.shape[1]
    idx = draft.unsqueeze(-1)  # [B, K, 1]
    p_d = torch.gather(p[:, :k], -1, idx).squeeze(-1)  # [B, K] target prob of each drafted token
    q_d = torch.gather(q, -1, idx).squeeze(-1)  # [B, K] draft prob of each drafted token
    accept = u_accept * q_d < p_d  # P(accept) = P(u < p/q) = min(1, p/q); never when p_d == 0
    n_acc = accepted_prefix(accept)  # [B]
    q_ext = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, K+1, V]: no draft mass at the bonus slot
    fix = sample_from_probs(residual_probs(p, q_ext), u_sample)  # [B, K+1] candidate token at every position
    col = torch.arange(k + 1, device=draft.device).unsqueeze(0)  # [1, K+1]
    draft_ext = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)  # [B, K+1]
    tokens = torch.where(col < n_acc.unsqueeze(1), draft_ext, fix)  # drafts, then the resampled/bonus token
    counts = n_acc + 1
    return _pad_after(tokens, counts), counts
