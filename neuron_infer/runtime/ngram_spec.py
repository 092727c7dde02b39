"""NgramSpec: prompt-lookup speculation over a target Engine and its verify graphs (no draft model).

Per step (host loop; there is no fused graph: the drafts come from the host, see `runtime/ngram.py`):
    drafts       propose(tokens, n, k) per scheduled sequence; plan_step decides each k (its draft or 0) or a plain step
    verify       verify_t{K+1}_s{S} over every batch slot: [last, d_1..d_k, filler] at p..p+K  -> logits [B, K+1, V]
    acceptance   per sequence over its own k: greedy_accept, or speculative_verify with the draft distribution a
                 point mass q = one_hot(d_i): accept d_i with probability p_i(d_i), else sample from
                 normalize(max(p_i - q_i, 0)) = p_i without d_i, renormalized; the bonus token from p_k.
Filler tokens past a row's k (and the other rows' slots) write cache slots that no accepted position attends to:
the next step writes its own position before attending, as in the draft-model host loop (model/spec_step.py).

The cost ratio (one verify step / one plain step) is measured from the steps this engine runs (an EWMA of each
step's wall time, the first of each kind skipped as warm-up: `runtime/step_clock.py`) and feeds `plan_step`. While
every step pays, no plain step would ever be timed and the ratio would stay at its prior; so after CALIBRATE_EVERY
speculative steps in a row (CALIBRATE_FIRST until a plain step is measured) one step is plain. The other way round,
while no step speculates the verify time is never re-measured: one slow verify step (a busy machine) would keep the
ratio high, every draft declined and - declined drafts being scored for free, which resets a sequence's probe count
- speculation off for the life of the engine. So after RECHECK_EVERY plain steps in a row, a step where some
sequence has a draft verifies it (one verify step's cost per RECHECK_EVERY plain steps when it does not pay).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

import torch

from neuron_infer.artifact.plan import graph_name
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.sampling import host_argmax, processed_probs
from neuron_infer.model.verify import greedy_accept, speculative_verify
from neuron_infer.runtime.buckets import pick_bucket
from neuron_infer.runtime.engine import Engine, Piece
from neuron_infer.runtime.ngram import RowView, SeqState, plan_step, propose
from neuron_infer.runtime.sequence import plain_only
from neuron_infer.runtime.step_clock import StepClock

PRIOR_COST_RATIO = 1.3  # verify / plain step time assumed until both are measured
CALIBRATE_EVERY = 32  # after this many speculative steps in a row, one plain step keeps the cost ratio measured
CALIBRATE_FIRST = 8  # ... and after this many while the plain step has no measurement yet
RECHECK_EVERY = 32  # after this many plain steps in a row, a step with a draft verifies it: the verify time stays fresh


class NgramSpec:
    """Prompt-lookup speculation for the Runner: `plan` drafts, `verify_tokens` checks them."""

    mode = "ngram"
    gate = None  # each sequence drafts while its own drafts pay (runtime/ngram.py)

    def __init__(self, target: Engine, graphs: dict, k: int, ngram_size: int):
        self.target, self.graphs, self.k, self.ngram_size = target, graphs, k, ngram_size
        self.build, self.vocab_size = target.build, target.vocab_size
        self.clock = StepClock()
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> SeqState
        self.spec_run = 0  # speculative steps since the last plain step
        self.plain_run = 0  # plain steps since the last speculative step

    def prefill_row(self, row: int, prompt: list[int], start: int = 0, end: int | None = None,
                    logit_rows: Sequence[int] | None = None) -> torch.Tensor:
        return self.target.prefill_row(row, prompt, start, end, logit_rows)

    def prefill_rows(self, pieces: list[Piece]) -> torch.Tensor:
        return self.target.prefill_rows(pieces)

    def can_speculate(self, seqs: Mapping[int, Sequence[int]]) -> bool:
        """A verify step writes positions p..p+K of every listed row: p + K + 1 <= max_length."""
        return max(len(t) for t in seqs.values()) + self.k <= self.build.max_length

    def decode_rows(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A plain step through the target (timed for the cost ratio)."""
        with self.clock.timing("plain"):
            return self.target.decode_rows(rows, tokens, positions)

    def step(self, run, scheduled: list, live: list) -> dict | None:
        """A prompt-lookup step over the scheduled sequences (per-sequence drafts, any mix of sampling rules), or
        None when no sequence drafts this step (the Runner takes a plain step). `run`: the Runner."""
        rows = {s.row: s.tokens for s in live}
        if (not self.can_speculate(rows) or not run.scheduler.has_room(live, self.k)
                or any(plain_only(s) for s in scheduled)):
            return None
        drafts = self.plan(scheduled, run.agree)  # [] per sequence without a draft this step
        if not any(drafts):
            return None
        logits = self.verify_logits(rows, {s.row: d for s, d in zip(scheduled, drafts)})  # [B, K+1, V]
        u = torch.zeros(len(scheduled), accept_uniforms(self.k))  # [m, 2K+1]
        for i, (s, d) in enumerate(zip(scheduled, drafts)):
            if not s.sampling.greedy:  # each sequence draws from its own generator
                u[i, : accept_uniforms(len(d))] = torch.rand(accept_uniforms(len(d)), generator=s.generator)
        if run.agree is not None and not all(s.sampling.greedy for s in scheduled):
            u = run.agree(u)
        accepted = {}
        for i, (s, d) in enumerate(zip(scheduled, drafts)):
            toks = accept(logits[s.row], d, s.sampling, s.generator, u[i, : accept_uniforms(len(d))])
            self.state(s).update(len(d), len(toks) - 1)
            accepted[s] = (toks, len(d))
        return run.emit_speculative(accepted)

    # ---- drafting --------------------------------------------------------------------------------------------
    def state(self, seq) -> SeqState:
        st = self.states.get(seq)
        if st is None:
            st = self.states[seq] = SeqState()
        return st

    def plan(self, seqs: list, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
        """Each sequence's drafts for this step ([] = none); all empty means a plain step. The draft lengths depend
        on this process's measured step times, so tensor-parallel ranks use rank 0's (`agree`)."""
        tokens = [s.tokens for s in seqs]  # prompt + output, built once per sequence
        for s, t in zip(seqs, tokens):
            self.state(s).observe(t)  # declined drafts of earlier steps, scored by the tokens since
        drafts = [propose(t, self.ngram_size, self.k) for t in tokens]
        views = [RowView(len(d), self.state(s).accepted, self.state(s).idle) for s, d in zip(seqs, drafts)]
        ks = plan_step(views, self.clock.ratio("verify", "plain", PRIOR_COST_RATIO))
        every = CALIBRATE_EVERY if self.clock.measured("plain") else CALIBRATE_FIRST
        if self.spec_run >= every:  # a plain step now and then: the ratio needs both steps timed
            ks = [0] * len(ks)
        elif self.plain_run >= RECHECK_EVERY and not any(ks):  # ... and a verify step now and then
            ks = [len(d) for d in drafts]
        if agree is not None:
            ks = agree(torch.tensor(ks, dtype=torch.int64)).tolist()  # [m] rank 0's draft lengths
        self.spec_run = self.spec_run + 1 if any(ks) else 0
        self.plain_run = 0 if any(ks) else self.plain_run + 1
        for s, t, d, k in zip(seqs, tokens, drafts, ks):
            if k == 0:
                self.state(s).update(0, 0)
                self.state(s).watch(len(t), d)
        return [d[:k] for d, k in zip(drafts, ks)]

    # ---- verify ----------------------------------------------------------------------------------------------
    def verify_logits(self, live: Mapping[int, Sequence[int]], drafts: Mapping[int, list[int]]) -> torch.Tensor:
        """One target pass over K+1 positions of every row. live: row -> tokens (the last not yet cached); drafts:
        row -> its draft tokens (<= K) -> logits [B, K+1, V]."""
        b, k = self.build.batch_size, self.k
        steps = torch.arange(k + 1, dtype=torch.int64)  # [K+1]
        ids = torch.zeros(b, k + 1, dtype=torch.int64)  # [B, K+1] free rows: token 0 at 0..K (junk rows)
        pos = steps.expand(b, k + 1).clone()  # [B, K+1]
        for row, toks in live.items():
            d = drafts.get(row, [])
            ids[row, 0] = toks[-1]
            ids[row, 1: 1 + len(d)] = torch.tensor(d, dtype=torch.int64)
            pos[row] = len(toks) - 1 + steps
        s = pick_bucket(int(pos.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        name = graph_name("verify", k + 1, s)
        if name not in self.graphs:
            raise NeuronInferError(f"compiled graph {name!r} is missing from the artifact; recompile")
        with torch.inference_mode(), self.clock.timing("verify"):
            table = self.target.table(range(b), s, self.target.min_table_width)  # [B, S/bs]
            return self.graphs[name](ids, pos, self.target.k_cache, self.target.v_cache, steps.expand(b, k + 1),
                                     table)  # [B, K+1, V]


def accept_uniforms(k: int) -> int:
    """Uniforms one sequence's sampled acceptance of k drafts uses: k acceptance tests, k+1 resample/bonus draws."""
    return 2 * k + 1


def accept(logits: torch.Tensor, draft: list[int], sampling: SamplingConfig, gen: torch.Generator | None,
           u: torch.Tensor | None = None) -> list[int]:
    """One sequence's tokens from its verify logits [>= k+1, V] and its k drafts: the accepted drafts and one
    target token (greedy: the target's argmax; sampling: the point-mass rejection rule with the uniforms u [2k+1],
    drawn from `gen` when not given)."""
    k = len(draft)
    d = torch.tensor([draft], dtype=torch.int64)  # [1, k]
    lg = logits[: k + 1].unsqueeze(0)  # [1, k+1, V]
    if sampling.greedy:
        tokens, counts = greedy_accept(d, host_argmax(lg))
    else:
        p = processed_probs(lg, sampling)  # [1, k+1, V]
        q = torch.nn.functional.one_hot(d, lg.shape[-1]).to(p.dtype)  # [1, k, V]: the point mass on each draft
        u = torch.rand(accept_uniforms(k), generator=gen) if u is None else u  # [2k+1]
        tokens, counts = speculative_verify(d, q, p, u[None, :k], u[None, k: 2 * k + 1])
    return tokens[0, : int(counts[0])].tolist()
