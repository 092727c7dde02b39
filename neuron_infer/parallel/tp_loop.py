"""The autoregressive loop every rank runs under tensor parallelism.

Same contract as `neuron_infer.runtime.generate.generate_ids`, with one difference: the token is decided on rank 0
and broadcast, so every rank feeds the same next input and takes the same stop decisions even if its logits were to
differ in the last bit. (They do not: the vocab all-gather hands every rank identical logits; the broadcast makes
that independent of the sampler.) All ranks seed their generator identically, so a rank that samples gets rank 0's
draws too. With `collect_logits`, rank 0 also returns each step's logits (tests compare them against tp = 1).
"""
from __future__ import annotations

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.parallel.launch import broadcast_from_rank0
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import Metrics, OnTokens, SequenceResult, generate_ids

GREEDY = SamplingConfig()  # temperature 0


def tp_generate_ids(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    eos_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    on_tokens: OnTokens | None = None,
    collect_logits: bool = False,
) -> tuple[list[SequenceResult], Metrics, list[torch.Tensor]]:
    """Generate up to `max_new_tokens` per prompt on this rank's engine; returns (results, metrics, logits)."""
    seen: list[torch.Tensor] = []
    results, metrics = generate_ids(engine, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, on_tokens,
                                    decide=broadcast_from_rank0,  # [B] rank 0's choice everywhere
                                    on_logits=(lambda t: seen.append(t.clone())) if collect_logits else None)
    return results, metrics, seen
