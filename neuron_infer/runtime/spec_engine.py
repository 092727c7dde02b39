"""SpecEngine: speculative generation over a target engine and a draft engine (fused graph or unfused host loop).

Graphs (per tokengen bucket S; names in the artifact, see compile/spec_builder.py):
    target   context_t{T}_s{T}, tokengen_t1_s{S}       (the core engine's graphs: prefill, and the tail)
             verify_t{K+1}_s{S}                          (unfused: the target pass over K+1 positions)
    draft    draft_context_t{T}_s{T}, draft_tokengen_t{1,2}_s{S}   (unfused draft passes, draft prefill)
             draft_tokengen_t8_s{S}                      (the draft's catch-up: 8 positions per pass)
    fused    fused_{greedy,sample}_k{K}_s{S}             (one graph: K draft passes + target pass + acceptance)

A step at newest-token position p uses the smallest bucket >= p + K + 1. When a row gets so close to max_length that
p + K + 1 > max_length, the rest of the generation runs as plain target decoding ("tail"), so a speculative block
never writes past the cache. Finished and idle rows are parked at position 1 (their batch slots hold no blocks, so
they write the scratch block).

Both caches are block caches with the same block numbers: the target engine's slot tables (`Engine.bind`) address
the draft cache too (the draft engine shares them). A fused graph is compiled for the artifact's default block count.

The draft cache is filled lazily. Prompt encoding and plain steps write only the target cache (so a plain step costs
what it costs without a draft, prompts may be encoded in chunks and after cached prefix blocks); before a speculative
step, `catch_up` writes the draft K/V the step needs: a row with nothing drafted or a long lag is encoded by the
draft's context graph (positions from 0, up to its largest context bucket), the rest by draft passes over every row
of CATCH_UP_TOKENS positions each (two with an artifact compiled without those graphs).
Per row the engine keeps the tokens whose draft K/V are in place (`drafted`), so a row whose speculative tokens
the caller discarded, or a new request in a reused row, is caught up from where its tokens really agree.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from neuron_infer.artifact.plan import CATCH_UP_TOKENS, fused_graph_name, graph_name
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.sampling import params_tensor
from neuron_infer.model.spec_step import SpecCacheLayout, speculate, uniforms_width, unpack
from neuron_infer.runtime.buckets import pick_bucket
from neuron_infer.runtime.engine import Engine, Piece
from neuron_infer.runtime.sequence import shared_rule
from neuron_infer.runtime.spec_gate import SpecGate

MODES = ("fused", "unfused")
PREFILL_LAG = 16  # a lag of more tokens is re-encoded by the draft's context graph rather than catch-up passes


def _agree(drafted: list[int], seq: Sequence[int]) -> int:
    """How many leading tokens of `seq` the draft cache holds (the common prefix of the two)."""
    n = min(len(drafted), len(seq))
    if list(seq[:n]) == drafted[:n]:
        return n
    return next(i for i in range(n) if drafted[i] != seq[i])


class SpecEngine:
    """Speculative decoding over a target Engine and a draft Engine whose caches share one flat buffer each."""

    def __init__(self, target: Engine, draft: Engine, spec_graphs: dict, layout: SpecCacheLayout, k: int,
                 mode: str = "unfused"):
        if mode not in MODES:
            raise NeuronInferError(f"speculation mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
        self.target, self.draft, self.graphs, self.layout, self.k = target, draft, spec_graphs, layout, k
        self.mode, self.build, self.vocab_size = mode, target.build, target.vocab_size
        self.k_flat, self.v_flat = layout.allocate()
        target.k_cache, draft.k_cache = layout.views(self.k_flat)
        target.v_cache, draft.v_cache = layout.views(self.v_flat)
        draft.slots, draft.pool = target.slots, target.pool  # one block table for both caches
        self.drafted: list[list[int]] = [[] for _ in range(target.build.batch_size)]  # per slot: draft K/V in place
        self.gate = SpecGate()  # what the speculation gate measured (used by Runners with the gate on)

    # ---- graphs ------------------------------------------------------------------------------------------------
    def _graph(self, graphs: dict, name: str):
        try:
            return graphs[name]
        except KeyError as e:
            hint = " (compile with --fused-speculation)" if name.startswith("fused") else ""
            raise NeuronInferError(f"compiled graph {name!r} is missing from the artifact{hint}; recompile") from e

    def _bucket(self, positions: torch.Tensor) -> int:
        return pick_bucket(int(positions.max()) + self.k + 1, self.build.tokengen_bucket_list, "sequence",
                           "--max-length")

    def step_all(self, last: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor, sampling: SamplingConfig,
             u: torch.Tensor | None = None, mode: str | None = None) -> dict[str, torch.Tensor]:
        """One speculative step for every row. last/prev/pos [B]; u [B, 3K+1] uniforms (sampling) -> see unpack."""
        mode, k, s = mode or self.mode, self.k, self._bucket(pos)
        ids2 = torch.stack([prev, last], dim=1).to(torch.int64)  # [B, 2]
        pos2 = torch.stack([pos - 1, pos], dim=1).to(torch.int64)  # [B, 2]
        u = torch.zeros(len(pos), uniforms_width(k)) if u is None else u  # [B, 3K+1]
        params = params_tensor(sampling.temperature, sampling.top_k, sampling.top_p)  # [3]
        with torch.inference_mode():
            if mode == "fused":
                if self.layout.target.blocks != self.build.default_kv_blocks:
                    raise NeuronInferError("fused speculation graphs hold the artifact's default KV cache; load "
                                           "without --kv-cache-gib, or run the speculation unfused")
                fn = self._graph(self.graphs, fused_graph_name(k, s, not sampling.greedy))
                packed = fn(ids2, pos2, self.k_flat, self.v_flat, u, params, self._table(s))
            else:
                packed = speculate(self._draft_fn(s), self._verify_fn(s), ids2, pos2, k, u, params,
                                   not sampling.greedy)
        return unpack(packed, k)

    def _table(self, s: int) -> torch.Tensor:
        return self.target.table(range(self.build.batch_size), s)  # [B, S/bs] every batch slot

    def _draft_fn(self, s: int):
        eng, table = self.draft, self._table(s)

        def run(ids, pos, li):
            fn = self._graph(eng.graphs, graph_name("tokengen", ids.shape[1], s))
            return fn(ids, pos, eng.k_cache, eng.v_cache, li, table)

        return run

    def _verify_fn(self, s: int):
        eng, fn, table = self.target, self._graph(self.graphs, graph_name("verify", self.k + 1, s)), self._table(s)
        return lambda ids, pos, li: fn(ids, pos, eng.k_cache, eng.v_cache, li, table)

    # ---- continuous batching: one request per batch slot, one step at a time (the Runner) ------------------------
    def prefill_row(self, row: int, prompt: list[int], start: int = 0, end: int | None = None,
                    logit_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Encode prompt[start:end] into the target blocks of slot `row` (Engine.prefill_row) -> target logits [V].
        The draft cache of the row is written before its first speculative step (`catch_up`)."""
        self.drafted[row] = []
        return self.target.prefill_row(row, prompt, start, end, logit_rows)

    def prefill_rows(self, pieces: list[Piece]) -> torch.Tensor:
        """Several pieces into the target blocks of their rows at once (Engine.prefill_rows) -> logits [n, V]; the
        rows' draft caches are written before their first speculative step (`catch_up`)."""
        for row, *_ in pieces:
            self.drafted[row] = []
        return self.target.prefill_rows(pieces)

    def catch_up(self, seqs: Mapping[int, Sequence[int]]) -> tuple[int, int]:
        """Write the draft K/V a speculative step over `seqs` needs (row -> all its tokens, the last one not yet
        cached): positions 0..len-3 of each row (the step's first draft pass writes len-2 and len-1) -> (draft
        passes run, positions that were missing); (0, 0): nothing lagged."""
        need = {row: len(seq) - 2 for row, seq in seqs.items()}
        have = {row: _agree(self.drafted[row], seqs[row]) for row in seqs}
        missing = sum(max(0, need[row] - have[row]) for row in seqs)
        passes = 0
        for row, n in need.items():
            m = min(n, self.build.max_context_length)
            if m > have[row] and (have[row] == 0 or n - have[row] > PREFILL_LAG):
                self.draft.prefill_row(row, list(seqs[row][:m]))  # positions 0..m-1
                have[row], passes = m, passes + 1
        while any(have[row] < need[row] for row in seqs):
            self._catch_up_pass(seqs, need, have)
            passes += 1
        for row, seq in seqs.items():
            self.drafted[row] = list(seq[: have[row]])
        return passes, missing

    def _catch_up_pass(self, seqs: Mapping[int, Sequence[int]], need: dict[int, int], have: dict[int, int]) -> None:
        """One draft pass of w positions per row (w = CATCH_UP_TOKENS, or 2 without its graph): a lagging row writes
        the w tokens from its first missing one, moved back to end at its last token; a caught-up row rewrites its
        last w (the step rewrites the last two anyway); a row shorter than w writes token 0 past its end (those
        slots are written again before anything reads them); parked rows write the scratch block. Advances `have`."""
        s = pick_bucket(min(max(len(q) for q in seqs.values()) + self.k, self.build.max_length),
                        self.build.tokengen_bucket_list, "sequence", "--max-length")
        w = CATCH_UP_TOKENS if graph_name("tokengen", CATCH_UP_TOKENS, s) in self.draft.graphs else 2
        ids = torch.zeros(self.build.batch_size, w, dtype=torch.int64)  # [B, w] parked rows: token 0 ...
        pos = torch.arange(w, dtype=torch.int64).repeat(self.build.batch_size, 1)  # [B, w] ... at 0..w-1
        for row, seq in seqs.items():
            first = have[row] if have[row] < need[row] else len(seq)
            start = max(0, min(first, len(seq) - w))
            window = list(seq[start: start + w])
            ids[row, : len(window)] = torch.tensor(window, dtype=torch.int64)
            pos[row] = torch.arange(start, start + w, dtype=torch.int64)
            have[row] = max(have[row], start + len(window))
        last = torch.full((self.build.batch_size, 1), w - 1, dtype=torch.int64)  # [B, 1] logits unused
        with torch.inference_mode():
            self._draft_fn(s)(ids, pos, last)

    def decode_rows(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A plain step through the target; the draft's cache is left to `catch_up` before the next speculative
        step."""
        return self.target.decode_rows(rows, tokens, positions)

    def step(self, run, scheduled: list, live: list) -> dict | None:
        """A speculative step (K drafts, one verify) over every live row when the scheduled sequences share one
        sampling rule, the step fits and the gate opens; else None (the Runner takes a plain step)."""
        rule = shared_rule(scheduled)
        rows = {s.row: s.tokens for s in live}  # every live row: its real tokens are rewritten
        room = run.scheduler.has_room(live, self.k)  # the caller's blocks may end sooner
        if rule is None or not self.can_speculate(rows) or not room or not run.gate_open(scheduled):
            return None
        u = None
        if not rule.greedy:  # each sequence draws its step's uniforms from its own generator
            u = torch.zeros(run.batch, uniforms_width(self.k))  # [B, 3K+1]
            for s in scheduled:
                u[s.row] = torch.rand(u.shape[1], generator=s.generator)
            if run.agree is not None:
                u = run.agree(u)
        gate = run.gate
        t0 = gate.clock.timer() if gate is not None else 0.0
        passes, missing = self.catch_up(rows)  # timed apart: the gate weighs it only against probing
        if gate is not None:
            gate.record_catch_up(gate.clock.timer() - t0, missing)
        run.stats.draft_catch_up += passes
        with run.timed("spec"):
            got = self.step_tokens(rows, rule, u)
        if gate is not None:
            gate.record_spec(sum(len(got[s.row]) for s in scheduled) / len(scheduled))
        return run.emit_speculative({s: (got[s.row], self.k) for s in scheduled})

    def can_speculate(self, seqs: Mapping[int, Sequence[int]]) -> bool:
        """Whether a speculative step fits every row of `seqs` (row -> tokens, the last one not yet cached): the
        step writes positions p..p+K, so p + K + 1 <= max_length for the newest token's position p."""
        return max(len(t) for t in seqs.values()) - 1 + self.k + 1 <= self.build.max_length

    def step_tokens(self, seqs: Mapping[int, Sequence[int]], sampling: SamplingConfig,
                    u: torch.Tensor | None = None) -> dict[int, list[int]]:
        """One speculative step (K drafts + one verify) over the rows of `seqs` (row -> all its tokens, >= 2, the
        last one not yet in the caches; every row holding a live request must be listed, other rows are parked) ->
        row -> its 1..K+1 accepted tokens. `sampling` applies to every row (one graph per step); u [B, 3K+1]."""
        last, prev, pos = self._parked()
        for row, seq in seqs.items():
            if len(seq) < 2:
                raise NeuronInferError(f"row {row} has {len(seq)} token(s); a speculative step needs the prompt "
                                       "and its first generated token (prefill_row, then sample)")
            last[row], prev[row], pos[row] = seq[-1], seq[-2], len(seq) - 1
        self.catch_up(seqs)
        res = self.step_all(last, prev, pos, sampling, u)
        got = {row: res["tokens"][row, : int(res["counts"][row])].tolist() for row in seqs}
        for row, seq in seqs.items():  # the drafts written at len..len+K-2 were the accepted tokens, as far as they go
            self.drafted[row] = list(seq) + got[row][: min(len(got[row]) - 1, self.k - 1)]
        return got

    def _parked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """last [B], prev [B], pos [B] of rows without a live request: token 0 at position 1 (junk rows)."""
        b = self.build.batch_size
        return (torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64),
                torch.ones(b, dtype=torch.int64))  # [B] each

    # ---- generation ----------------------------------------------------------------------------------------------
    def with_mode(self, mode: str | None) -> SpecEngine:
        """This engine (same graphs and caches) running its steps fused or unfused."""
        if mode is None or mode == self.mode:
            return self
        if mode not in MODES:
            raise NeuronInferError(f"speculation mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
        other = copy.copy(self)
        other.mode = mode
        return other
