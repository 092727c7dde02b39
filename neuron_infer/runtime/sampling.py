"""Token selection: greedy, temperature, top-k, top-p — one definition of the processed distribution.

`processed_probs` is the single place where temperature / top-k / top-p are applied, so speculative decoding can
apply exactly the same transformation to the target's and the draft's logits (losslessness depends on it).
"""
from __future__ import annotations

import torch

from neuron_infer.config import SamplingConfig


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32) after temperature, top-k and top-p.

    Greedy (temperature 0) returns a one-hot distribution on the argmax (ties -> lowest id, like torch.argmax).
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < cfg.top_p  # always keeps the top token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    if cfg.greedy:
        return logits.argmax(-1)
    return torch.multinomial(processed_probs(logits, cfg), 1, generator=gen).squeeze(-1)
