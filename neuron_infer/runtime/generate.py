"""Generation to completion: add every prompt to the Scheduler, then step the Runner until all sequences finish.

This is `CompiledModel.generate` (tp = 1, or every rank of a tensor-parallel group with `agree`). Prompts beyond
the artifact's batch size, or beyond what the KV cache's free blocks can promise, wait and start as earlier sequences
finish (continuous batching).
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.sampling import check_vocab, make_generator
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.metrics import Metrics
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.runner import Agree, Runner
from neuron_infer.runtime.sequence import Sequence, StopRule, check_prompt
from neuron_infer.runtime.speculation import Speculation


@dataclass
class SequenceResult:
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "max_new_tokens" | "max_length"
    logprobs: list[dict] | None = None  # per output token (see Sequence.logprobs), when asked for
    prompt_logprobs: list[dict] | None = None  # per prompt token after the first (Sequence.prompt_records)


OnTokens = Callable[[list[list[int]]], None]  # called after each step with every sequence's tokens so far


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a generation loop (restored afterwards, also on errors).

    A decode step allocates a few Python objects, so every few hundred steps a collection walks all the objects
    torch and transformers created at import (hundreds of thousands): a stall of milliseconds inside a decode
    step. The loop creates no reference cycles; reference counting frees its garbage at once.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def generate_ids(
    engine: Engine | Speculation,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen, never mutated)
    eos_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    on_tokens: OnTokens | None = None,
    agree: Agree | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
    stop: StopRule | None = None,
    logprobs: int | None = None,
    options: RunOptions = RunOptions(),  # noqa: B008 (frozen)
    prompt_logprobs: int | None = None,
    grammar: Callable[[], object] | None = None,
) -> tuple[list[SequenceResult], Metrics]:
    """Generate up to `max_new_tokens` per prompt; speculative steps when `engine` is a speculation strategy
    (what load_rank gives for a speculative artifact: runtime/speculation.py), plain steps on an Engine.

    All sequences draw from one generator seeded with `sampling.seed`. `agree` maps sampled tokens to the tokens
    actually used (tensor parallelism: rank 0's choice, broadcast); `on_logits` sees the logits [n, V] of every
    sampled position of a plain step or prefill. `stop`: stop strings and their decoder (its count fields are
    replaced by this call's); `logprobs`: record each output token's log-probability and the top-N alternatives;
    `prompt_logprobs`: score every prompt token after the first (its logprob and the top-N alternatives);
    `grammar`: a factory of per-sequence token grammars (runtime/grammar.py `token_grammar`: structured output);
    `options`: prefix caching (prompts whose first blocks are cached, by earlier prompts of this call or an earlier
    call on the same engine, encode only the rest) and chunked prefill (a prompt that starts while others decode is
    encoded a chunk per step).
    """
    build = engine.build
    if not prompts:
        raise NeuronInferError("got no prompts; pass at least one")
    for i, p in enumerate(prompts):
        check_prompt(f"prompt {i}", p, build.max_context_length, engine.vocab_size)
    check_vocab(sampling, engine.vocab_size)
    gen = make_generator(sampling.seed)
    stop = StopRule(max_new_tokens, eos_ids, ignore_eos, build.max_length,
                    stop.stop_strings if stop else (), stop.decode if stop else None)
    seqs = [Sequence(i, list(p), sampling, stop, gen, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                     grammar=grammar() if grammar is not None else None) for i, p in enumerate(prompts)]
    runner = Runner(engine, agree, on_logits, keep_step_counts=True, options=options)
    sched = runner.scheduler
    for s in seqs:
        sched.add(s)
    metrics = runner.stats
    with gc_paused():
        start = t0 = time.perf_counter()
        while sched.has_work:
            running = runner.decoding()
            runner.step(running, running)  # before the prefill of new sequences (the step writes every row)
            runner.prefill(sched.admit())  # new prompts, and the next chunk of those still encoding
            sched.release_finished()
            if on_tokens:
                on_tokens([s.output for s in seqs])
            now = time.perf_counter()  # latency = emission to emission: the whole loop, bookkeeping and callbacks
            if running:
                metrics.token_latencies_s.append(now - t0)
            elif not metrics.ttft_s and any(s.output for s in seqs):
                metrics.ttft_s = now - start
            t0 = now
    metrics.num_generated = max(len(s.output) for s in seqs)
    metrics.decode_tokens = sum(len(s.output) - 1 for s in seqs)
    metrics.finish(min(len(seqs), build.batch_size))
    return [SequenceResult(s.output, s.finish_reason or "max_new_tokens", s.output_logprobs, s.prompt_records)
            for s in seqs], metrics
