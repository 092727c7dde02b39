"""The Runner: one step — plain or speculative — over the scheduled sequences, through the Engine.

Every caller drives this one runner: `generate_ids` (CompiledModel.generate: add every prompt, step until done),
each tensor-parallel rank (fed identical decisions), and the vLLM worker (which maps vLLM's scheduler output onto
it). A step produces 1 token per scheduled sequence, or 1..K+1 when a speculation strategy (runtime/speculation.py)
takes it.

Slot contents per state, for a plain step (one token-generation graph over every batch slot):
    running, scheduled      its pending token's K/V is written at position len-1 (the real step)
    running, not scheduled  the same pending token is rewritten at the same position: the same K/V, which the
                            sequence's next real step writes again anyway
    free                    token 0 at position 0, into the scratch block (its table is all block 0)
Before each step and prefill the runner takes the blocks the step may write from the scheduler (`Scheduler.grow`)
and binds every slot's blocks on the engine (free slots: none), so a graph never writes another sequence's blocks.
With prefix caching, a newly admitted sequence whose first blocks were cached encodes only the rest of its prompt.
With chunked prefill (`prefill`), a prompt that starts while others decode is encoded a chunk per call; until its
last chunk the sequence sits decode steps out (its slot is bound to no blocks for them, like a free slot).

Speculation: one graph serves one sampling rule per step, so a step is plain when the scheduled sequences mix
greedy and sampled or different temperature / top-k / top-p, when a sequence asks for logprobs or uses penalties,
min-p or logit_bias, has not reached its min_tokens or is held to a grammar's mask, and near max_length where a
speculative block would not fit (or, with the caller's blocks, past the end of a row's last block: vLLM allocates blocks only for the tokens it scheduled). Plain steps and prompt encoding write only
the target cache; before a speculative step the draft catches up on what it missed (`SpecEngine.catch_up`).

With `gate`, a step that could speculate still takes a plain step while speculative steps are measured not to
pay (`runtime/spec_gate.py`; it probes now and then), unless a scheduled sequence is seeded (its tokens would then
follow measured times).

Prompt lookup (`--draft-model ngram`, an NgramSpec): drafts are copied from each sequence's own tokens, so rows
may mix sampling rules; `runtime/ngram.py` decides per step which sequences draft how many tokens (all none: a plain
step through the batch buckets), one verify graph checks them (`_lookup`).

Tensor parallelism: every rank runs this runner on identical logits (the vocab all-gather hands each rank the whole
row), but an unseeded generator is seeded from OS entropy per process, so each random draw is made the same on every
rank by `agree` (rank 0's tensor, broadcast):
    plain step / prefill   the sampled tokens [n]
    draft-model step       the step's uniforms [B, 3K+1], before the step: the draft (whole on every rank, see
                           docs/speculation.md) samples its K tokens from them inside the step, and those drafts are
                           the target's input on every rank, so they must be equal before the target pass runs;
                           agreeing on the accepted tokens afterwards would come too late (a rank that drafted
                           other tokens has already fed them to the collectives and written their K/V)
    gate (draft model)     whether a step that could speculate does [1] (`SpecGate` weighs measured step times,
                           which differ per process)
    prompt-lookup step     the draft lengths [m] (`NgramSpec.plan` weighs measured step times, which differ per
                           process), then each sequence's acceptance uniforms [m, 2K+1]: the drafts come from the
                           sequence's own tokens (equal everywhere), so equal uniforms give equal accepted tokens
Greedy steps draw nothing (argmax of equal logits). Uniforms rather than tokens for both kinds of speculative step:
one rule, and with a seed every rank's generator already draws rank 0's numbers, so a seeded draft-model run emits
the tokens of tp = 1 up to the float differences of the sharded sums. (A seeded prompt-lookup run is not
reproducible even at tp = 1: its draft lengths, and so the uniforms it draws, follow measured step times.)
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from neuron_infer.artifact.plan import graph_name
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.sampling import (
    draw_uniforms,
    logit_adjustment,
    sample_rows,
    token_history,
    token_logprobs,
)
from neuron_infer.runtime.engine import Engine, take_rows
from neuron_infer.runtime.metrics import Metrics
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.scheduler import Scheduler
from neuron_infer.runtime.sequence import Sequence
from neuron_infer.runtime.speculation import Speculation, split

Agree = Callable[[torch.Tensor], torch.Tensor]  # a tensor drawn here -> rank 0's (same shape) on every rank


class Runner:
    """Runs steps over sequences that hold batch slots and cache blocks; counts what it did in `stats` (one Metrics)."""

    def __init__(self, model: Engine | Speculation, agree: Agree | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None, keep_step_counts: bool = False,
                 options: RunOptions = RunOptions()):  # noqa: B008 (frozen)
        """model: an Engine (plain steps) or a speculation strategy over one (SpecEngine: a draft model; NgramSpec:
        prompt lookup), which takes each step it can serve. options: prefix caching, chunked prefill and the
        speculation gate (with a draft model, speculate only while speculative steps are measured to pay,
        `SpecGate`, kept on the SpecEngine; off, every step that can speculate does: fixed-k experiments)."""
        self.engine, self.spec = split(model)
        self.agree, self.on_logits = agree, on_logits
        self.keep_step_counts = keep_step_counts  # per (step, sequence) emitted counts: bounded runs only
        self.batch, self.max_length = self.engine.build.batch_size, self.engine.build.max_length
        self.chunk = options.chunk_tokens(self.engine.build)  # 0: whole prompts
        pool = self.engine.pool
        pool.release_all()  # one runner drives an engine at a time: earlier runners' sequences are gone
        pool.prefix_caching = options.prefix_caching
        self.lookahead = self.spec.k if self.spec is not None else 0
        self.scheduler = Scheduler(self.batch, pool, self.lookahead, self.max_length)
        self.encoding: dict[Sequence, int] = {}  # admitted sequences still encoding -> positions encoded (in order)
        self.gate = self.spec.gate if options.speculation_gate and self.spec is not None else None
        self.stats = Metrics()
        self.reset_stats()

    def reset_stats(self) -> None:
        spec = self.spec
        self.stats = Metrics(k=spec.k if spec is not None else 0, mode=spec.mode if spec is not None else "")

    # ---- prefill: encode admitted sequences into their rows ---------------------------------------------------
    def decoding(self) -> list[Sequence]:
        """Running sequences whose prompt is encoded (they take decode steps), in admission order."""
        return [s for s in self.scheduler.running if s not in self.encoding]

    def prefill(self, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """Newly admitted `seqs` join the sequences still encoding; encode prompts (each into its own row, other rows
        untouched) -> the first token of each sequence whose prompt is now complete.

        While other sequences decode, at most `chunk` prompt tokens are encoded per call (chunked prefill, in
        admission order), so a long prompt joining the batch delays each of their steps by one chunk instead of its
        whole prefill; with no sequence decoding there is no one to delay and prompts are encoded whole."""
        for s in seqs:
            self.begin(s)
        busy = self.chunk and any(s not in self.encoding for s in self.scheduler.running)
        budget = self.chunk if busy else None
        upto: dict[Sequence, int] = {}
        for s in list(self.encoding):
            if budget is not None and budget <= 0:
                break
            upto[s] = len(s) if budget is None else min(len(s), self.encoding[s] + budget)
            if budget is not None:
                budget -= upto[s] - self.encoding[s]
        return self.prefill_to(upto)

    def begin(self, seq: Sequence) -> None:
        """`seq` (admitted) starts encoding after its cached positions; it sits decode steps out until its prompt is
        complete."""
        self.encoding[seq] = seq.cached

    def prefill_to(self, upto: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Encode each sequence (admitted, still encoding) up to its position in `upto` (the vLLM worker: vLLM's
        scheduler chose the chunks) -> the first token of each whose prompt is now complete."""
        for s in upto:
            self.encoding.setdefault(s, s.cached)
        done = self._encode_all({s: min(end, len(s)) for s, end in upto.items()})
        return self._emit(list(done), torch.stack(list(done.values()))) if done else {}

    def release(self, seq: Sequence) -> None:
        """Free the slot and blocks of a running sequence, encoded or not."""
        self.scheduler.release(seq, cache=self.encoding.pop(seq, None) is None)

    def _encode_all(self, upto: dict[Sequence, int]) -> dict[Sequence, torch.Tensor]:
        """Encode each seq.tokens[encoded:end] -> next-token logits [V] of each sequence whose prompt is now complete
        (it leaves `encoding` and its full blocks enter the prefix cache). Pieces that fit the largest context
        bucket go through Engine.prefill_rows together (one call where the artifact has the batched prefill graph);
        longer ones, and those scoring their prompt, one by one in pieces of at most that bucket."""
        for s in upto:
            self.scheduler.grow(s, len(s) + 1)  # the prompt and the first decode step's position
        self._bind()
        piece = self.engine.build.max_context_length
        together = [s for s, end in upto.items()
                    if 0 < end - self.encoding[s] <= piece and s.prompt_logprobs is None]
        logits: dict[Sequence, torch.Tensor] = {}
        if together:
            encode = self.spec if self.spec is not None else self.engine  # a draft model notes its rows lag
            rows = encode.prefill_rows([(s.row, s.tokens, self.encoding[s], upto[s]) for s in together])
            logits.update(zip(together, rows))  # [V] each
        for s, end in upto.items():
            if s not in logits and self.encoding[s] < end:
                logits[s] = self._encode_alone(s, end)
        done = {}
        for s, end in upto.items():
            self.encoding[s] = max(self.encoding[s], end)
            if self.encoding[s] < len(s):
                continue
            del self.encoding[s]
            self.scheduler.cache_blocks(s)
            done[s] = logits[s]
        if done:
            self._note_blocks()
        return done

    def _encode_alone(self, seq: Sequence, end: int) -> torch.Tensor:
        """Encode seq.tokens[encoded:end] in pieces of at most the largest context bucket -> logits [V] after its
        last token."""
        encode = self.spec.prefill_row if self.spec is not None else self.engine.prefill_row
        start, piece, logits = self.encoding[seq], self.engine.build.max_context_length, None
        while start < end:
            stop = min(end, start + piece)
            if seq.prompt_logprobs is not None:
                logits = self._encode_scored(encode, seq, start, stop)
            else:
                logits = encode(seq.row, seq.tokens, start, stop)
            start = stop
        return logits

    def _encode_scored(self, encode: Callable, seq: Sequence, start: int, stop: int) -> torch.Tensor:
        """Encode seq.tokens[start:stop] and record the prompt logprobs it yields (the logits after position p
        score prompt token p+1; raw log-softmax, as the sample logprobs) -> logits [V] after its last token.

        The vocabulary head runs over every position of the piece only for such sequences: eager graphs and the
        compiled prefill shape class take all the piece's rows as `logit_index` in one call; static compiled graphs
        (Neuron) take the one row they were exported with, so there the piece is encoded once per row (each call
        writes the same K/V again)."""
        rows = list(range(stop - start))
        if _takes_logit_rows(self.engine, len(rows), start):
            logits = encode(seq.row, seq.tokens, start, stop, logit_rows=rows)  # [n, V]
        else:
            logits = torch.cat([encode(seq.row, seq.tokens, start, stop, logit_rows=[i]) for i in rows])  # [n, V]
        scored = min(stop, len(seq.prompt) - 1) - start  # positions start.. that predict a prompt token
        if scored > 0:
            targets = torch.tensor(seq.prompt[start + 1: start + 1 + scored], dtype=torch.int64)  # [scored]
            seq.prompt_records.extend(token_logprobs(logits[:scored], targets, seq.prompt_logprobs))
        return logits[-1]

    def _bind(self, idle: dict | None = None) -> None:
        """Every slot's blocks on the engine (free slots, and the sequences in `idle`: none, so their rows write
        the scratch block)."""
        held = {s.row: s.blocks for s in self.scheduler.running if not idle or s not in idle}
        for slot in range(self.batch):
            self.engine.bind(slot, held.get(slot, []))

    def _note_blocks(self) -> None:
        pool, st = self.engine.pool, self.stats
        st.kv_blocks, st.prefix_blocks_queried, st.prefix_blocks_hit = pool.usable, pool.queries, pool.hits
        st.kv_blocks_in_use = max(st.kv_blocks_in_use, pool.in_use)

    # ---- one step ------------------------------------------------------------------------------------------------
    def step(self, scheduled: list[Sequence], live: list[Sequence]) -> dict[Sequence, list[int]]:
        """One step over every row; the new tokens of each scheduled sequence (after its stop rule). `live`: every
        sequence holding a row (its pending token is rewritten where it already is)."""
        scheduled = [s for s in scheduled if s not in self.encoding]
        live = [s for s in live if s not in self.encoding]
        if not scheduled:
            return {}
        for s in live:
            self.scheduler.grow(s, len(s) + self.lookahead)  # positions len-1 .. len-1+K
        self._bind(idle=self.encoding)  # rows still encoding their prompt sit this step out
        longest = max(len(s) for s in live)
        if longest > self.max_length:
            raise NeuronInferError(f"a request reached {longest} tokens, beyond the artifact's max_length="
                                   f"{self.max_length}; serve with --max-model-len <= {self.max_length}")
        got = self.spec.step(self, scheduled, live) if self.spec is not None else None  # None: not this step
        return got if got is not None else self._plain(scheduled, live)

    def _plain(self, scheduled: list[Sequence], live: list[Sequence]) -> dict[Sequence, list[int]]:
        self.stats.plain_steps += 1
        tokens = torch.tensor([s.tokens[-1] for s in live], dtype=torch.int64)  # [n] pending tokens ...
        positions = torch.tensor([len(s) - 1 for s in live], dtype=torch.int64)  # [n] ... at their own slots
        rows = [s.row for s in live]
        # the smallest graph holding the live rows; a draft model's cache is left to `SpecEngine.catch_up`
        decode = (self.spec if self.spec is not None else self.engine).decode_rows
        with self.timed("plain"):
            logits = decode(rows, tokens, positions)  # [n, V]
        at = {s: i for i, s in enumerate(live)}
        return self._emit(scheduled, take_rows(logits, [at[s] for s in scheduled]))  # [m, V]

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> dict[Sequence, list[int]]:
        """Sample every sequence in one call (logits [n, V]), agree across ranks, append under the stop rules."""
        if self.on_logits is not None:
            self.on_logits(logits)
        configs = [s.sampling for s in seqs]
        for s in seqs:
            if s.grammar is not None:
                s.allowed = s.grammar.allowed()  # [V]
        history = None
        if any(c.penalized for c in configs):  # per-row token counts of prompt + output
            history = token_history([s.prompt for s in seqs], [s.output for s in seqs], logits.shape[-1])
        bias, allowed = None, [s.allowed for s in seqs]
        constrained = any(a is not None for a in allowed)
        if constrained or any(c.biased for c in configs):  # logit_bias; min_tokens; a grammar's mask
            bias = logit_adjustment(configs, [len(s.output) for s in seqs], [s.held_ids for s in seqs],
                                    logits.shape[-1], allowed)  # [n, V] or None
        u = draw_uniforms(configs, [s.generator for s in seqs])
        toks = sample_rows(logits, configs, u, history, bias)  # [n]
        if self.agree is not None:
            toks = self.agree(toks)
        for s in seqs:
            s.allowed = None  # a mask holds for one token
        want = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if want:
            scored = logits
            if constrained:  # as vLLM: logprobs of the masked logits (disallowed tokens -inf)
                masked = torch.stack([torch.ones_like(logits[0], dtype=torch.bool) if a is None else a
                                      for a in allowed])  # [n, V]
                scored = logits.float().masked_fill(~masked, float("-inf"))
            got = token_logprobs(scored[want], toks[want], max(seqs[i].logprobs for i in want))
            for i, rec in zip(want, got):
                rec["top"] = rec["top"][: seqs[i].logprobs]
                seqs[i].output_logprobs.append(rec)
        out = {s: s.append([t]) for s, t in zip(seqs, toks.tolist())}
        for s, kept in out.items():
            if s.grammar is not None:
                for t in kept:
                    s.grammar.accept(t)
        return out

    def emit_speculative(self, accepted: dict[Sequence, tuple[list[int], int]]) -> dict[Sequence, list[int]]:
        """A speculative step's tokens (sequence -> (accepted drafts and the bonus token, tokens drafted)): counted,
        then appended under each sequence's stop rule."""
        st, out = self.stats, {}
        st.spec_steps += 1
        for s, (toks, drafted) in accepted.items():
            st.drafted += drafted
            st.accepted += len(toks) - 1
            if self.keep_step_counts:
                st.emitted_per_step.append(len(toks))
            out[s] = s.append(toks)
        return out

    # ---- the speculation gate (draft models) ---------------------------------------------------------------------
    def gate_open(self, scheduled: list[Sequence]) -> bool:
        """Whether this step, which could speculate, does: always without a gate or when a scheduled sequence
        samples with a seed (its random draws, and so its tokens, depend on the kind of each step: seeded output
        stays reproducible; greedy draws nothing); otherwise the gate's choice (rank 0's, `agree`d: each rank
        measures its own step times)."""
        if self.gate is None or any(not s.sampling.greedy and s.sampling.seed is not None for s in scheduled):
            return True
        go = self.gate.want()
        self.stats.gate = self.gate.summary()  # this rank's measurements (the decision may be rank 0's)
        if self.agree is not None:
            go = bool(self.agree(torch.tensor([int(go)], dtype=torch.int64))[0])  # [1] rank 0's choice
        if not go:
            self.gate.record_plain()
            self.stats.gated_steps += 1
        return go

    def timed(self, kind: str) -> contextlib.AbstractContextManager:
        return self.gate.clock.timing(kind) if self.gate is not None else contextlib.nullcontext()


def _takes_logit_rows(engine: Engine, n: int, start: int) -> bool:
    """Whether the context graph encoding n tokens from `start` takes any number of logit rows: an eager graph (the
    nn.Module itself) and the prefill shape class (logit_index [1, R], R dynamic) do; a static compiled graph has
    the logit_index [1, 1] it was exported with."""
    t, s = engine.context_graph(n, start)
    return engine.shape_classes or isinstance(engine.graphs.get(graph_name("context", t, s)), torch.nn.Module)
