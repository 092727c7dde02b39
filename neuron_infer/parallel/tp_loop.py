"""The autoregressive loop every rank runs under tensor parallelism.

Same contract as `neuron_infer.runtime.generate.generate_ids`, with one difference: the token is decided on rank 0
and broadcast, so every rank feeds the same next input and takes the same stop decisions even if its logits were to
differ in the last bit. (They do not: the vocab all-gather hands every rank identical logits; the broadcast makes
that independent of the sampler.) All ranks seed their generator identically, so a rank that samples gets rank 0's
draws too. With `collect_logits`, rank 0 also returns each step's logits (tests compare them against tp = 1).
"""
from __future__ import annotations

import time

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.parallel.launch import broadcast_from_rank0
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import Metrics, OnTokens, SequenceResult, _accept, _check_prompts
from neuron_infer.runtime.sampling import make_generator, sample

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
    build = engine.build
    _check_prompts(prompts, build.batch_size, build.max_context_length)
    gen, n, metrics = make_generator(sampling.seed), len(prompts), Metrics()
    out: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    lengths = torch.tensor([len(p) for p in prompts] + [1] * (build.batch_size - n))  # [B] tokens in cache + next
    seen: list[torch.Tensor] = []
    t0 = time.perf_counter()
    logits = engine.prefill(prompts)  # [B, V], identical on every rank (vocab all-gather)
    while True:
        if collect_logits:
            seen.append(logits[:n].clone())  # [n, V]
        tokens = broadcast_from_rank0(sample(logits, sampling, gen))  # [B] rank 0's choice everywhere
        now = time.perf_counter()
        if metrics.num_generated == 0:
            metrics.ttft_s = now - t0
        else:
            metrics.token_latencies_s.append(now - t0)
        _accept(tokens, out, reasons, lengths, max_new_tokens, build.max_length, eos_ids, ignore_eos)
        metrics.num_generated += 1
        if on_tokens:
            on_tokens(out)
        if all(r is not None for r in reasons):
            break
        t0 = time.perf_counter()
        positions = (lengths - 1).clamp(min=0)  # the new token is written at index len-1 (its own position)
        logits = engine.decode(tokens, positions)  # [B, V]
    metrics.finish(n)
    return [SequenceResult(o, r or "max_new_tokens") for o, r in zip(out, reasons)], metrics, seen
