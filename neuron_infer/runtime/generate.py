"""The autoregressive loop: prefill, sample, decode step by step, stop per sequence, measure."""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.metrics import Metrics
from neuron_infer.runtime.sampling import make_generator, sample


@dataclass
class SequenceResult:
    token_ids: list[int]
    finish_reason: str  # "eos" | "max_new_tokens" | "max_length"


OnTokens = Callable[[list[list[int]]], None]  # called with each row's tokens generated so far


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a generation loop (restored afterwards, also on errors).

    A decode step allocates a few Python objects, so every few hundred steps a collection walks all the objects
    torch and transformers created at import (hundreds of thousands): a stall of milliseconds inside a step of
    ~7 ms. The loop creates no reference cycles; reference counting frees its garbage at once.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_prompts(prompts: list[list[int]], batch: int, max_ctx: int) -> None:
    if not prompts or len(prompts) > batch:
        raise NeuronInferError(f"got {len(prompts)} prompts for a build of batch size {batch}; pass 1..{batch}")
    for i, p in enumerate(prompts):
        if not p:
            raise NeuronInferError(f"prompt {i} is empty after tokenization; give at least one token")
        if len(p) > max_ctx:
            raise NeuronInferError(
                f"prompt {i} has {len(p)} tokens, more than max_context_length={max_ctx}; shorten it or recompile "
                "with a larger --max-context-length"
            )


def generate_ids(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen, never mutated)
    eos_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    on_tokens: OnTokens | None = None,
    decide: Callable[[torch.Tensor], torch.Tensor] | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[SequenceResult], Metrics]:
    """Generate up to `max_new_tokens` per prompt (a static batch of <= batch_size prompts).

    `decide` maps the sampled tokens [B] to the tokens actually used (tensor parallelism: rank 0's choice,
    broadcast); `on_logits` sees each step's logits of the real rows [n, V].
    """
    build = engine.build
    _check_prompts(prompts, build.batch_size, build.max_context_length)
    gen, n, metrics = make_generator(sampling.seed), len(prompts), Metrics()
    out: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    lengths = [len(p) for p in prompts] + [1] * (build.batch_size - n)  # [B] tokens in cache + next
    with gc_paused():
        t0 = time.perf_counter()
        logits = engine.prefill(prompts)
        while True:
            if on_logits:
                on_logits(logits[:n])
            tokens = torch.zeros(len(lengths), dtype=torch.int64)  # [B]: idle rows feed token 0
            tokens[:n] = sample(logits[:n], sampling, gen)  # [n]
            if decide:
                tokens = decide(tokens)
            _accept(tokens.tolist(), out, reasons, lengths, max_new_tokens, build.max_length, eos_ids, ignore_eos)
            if on_tokens:
                on_tokens(out)
            now = time.perf_counter()  # latency = emission to emission: the whole loop, bookkeeping and callbacks
            if metrics.num_generated == 0:
                metrics.ttft_s = now - t0
            else:
                metrics.token_latencies_s.append(now - t0)
            metrics.num_generated += 1
            if all(r is not None for r in reasons):
                break
            t0 = now
            positions = torch.tensor([max(length - 1, 0) for length in lengths])  # [B] slot of each new token
            logits = engine.decode(tokens, positions)
    metrics.decode_tokens = sum(len(o) - 1 for o in out)
    metrics.finish(n)
    return [SequenceResult(o, r or "max_new_tokens") for o, r in zip(out, reasons)], metrics


def _accept(tokens: list[int], out, reasons, lengths: list[int], max_new, max_length, eos_ids, ignore_eos) -> None:
    """Append each active row's new token and decide whether the row stops."""
    for row in range(len(out)):
        if reasons[row] is not None:
            continue
        tok = tokens[row]
        out[row].append(tok)
        lengths[row] += 1
        if not ignore_eos and tok in eos_ids:
            reasons[row] = "eos"
        elif len(out[row]) >= max_new:
            reasons[row] = "max_new_tokens"
        elif lengths[row] >= max_length:
            reasons[row] = "max_length"
    for row in range(len(out), len(lengths)):
        lengths[row] = 1  # idle padding rows stay at slot 0
