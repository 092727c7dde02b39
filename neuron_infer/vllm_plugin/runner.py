"""Continuous batching over the static-batch engine: vLLM requests <-> cache rows ("slots").

The engine keeps a KV cache of `batch_size` rows. A request joining the batch gets a free row and is encoded into
it alone (`Engine.prefill_row`: other rows untouched); every step then runs ONE token-generation graph over all
rows (`Engine.decode`) and each scheduled request samples its next token from its own row with its own sampler
state. A finished request frees its row for the next one. No vLLM types here: `worker.py` adapts vLLM's
SchedulerOutput / ModelRunnerOutput to these calls, so this file is tested directly against `generate_ids`.

Per step, decode runs before new requests are encoded: the decode graph writes every row, and the rows of
requests that are about to join would otherwise be overwritten after their prefill. Row contents per state:
    running, scheduled      decode writes its pending token's K/V at position len-1 (the real step)
    running, not scheduled  decode rewrites the same pending token at the same position: the same K/V, which the
                            request's next real step writes again anyway
    free                    token 0 at position 0 (garbage in a row that is re-encoded before any use)

With a speculative artifact (`spec`, a SpecEngine: draft model compiled in) a step is one speculative step over all
rows instead (K draft tokens + one target pass, fused into one graph when compiled with --fused-speculation) and
each request gets its 1..K+1 accepted tokens; vLLM's scheduler takes several sampled tokens per request per step
and trims them at a stop (EOS, stop ids, max_tokens, max_model_len). One graph serves one sampling rule per step, so
a step falls back to a plain target step (which also writes the draft cache, so speculation resumes afterwards)
when the scheduled requests mix greedy and sampled or different temperature/top-k/top-p, and near max_length
where a speculative block would not fit. Greedy output equals the non-speculative runner's (fp32; see
runtime/spec_engine.py for bf16 near-ties).

Tensor parallelism: every rank runs its own SlotRunner over its shard's engine, fed the same scheduler steps, so
slots, rows and graph calls (with their collectives) line up across ranks. `agree` maps each step's sampled tokens
to the ones every rank uses (rank 0's, broadcast): the logits are identical everywhere (vocab all-gather), but an
unseeded request's generator is seeded from OS entropy per process, so sampled tokens would otherwise diverge.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.metrics import Metrics
from neuron_infer.runtime.sampling import draw_uniforms, make_generator, sample_rows
from neuron_infer.runtime.spec_engine import SpecEngine
from neuron_infer.runtime.spec_step import uniforms_width


@dataclass
class Slot:
    """One request in the batch: its cache row, all its tokens (prompt + generated; the last one is not yet in
    the cache) and its own sampler state."""

    row: int
    tokens: list[int]
    sampling: SamplingConfig
    generator: torch.Generator


class SlotRunner:
    """Maps request ids to cache rows and produces 1 (or, speculating, 1..K+1) tokens per scheduled request per
    step."""

    def __init__(self, engine: Engine, spec: SpecEngine | None = None,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if spec is not None and agree is not None:
            raise NeuronInferError("speculative decoding runs at tensor-parallel degree 1 only; serve the speculative "
                                   "artifact with --tensor-parallel-size 1")
        self.engine, self.spec, self.agree = engine, spec, agree
        self.stats = Metrics()
        self.reset_stats()
        self.batch = engine.build.batch_size
        self.max_context = engine.build.max_context_length
        self.max_length = engine.build.max_length
        self.slots: dict[str, Slot] = {}
        # Free rows, lowest handed out first: the row a request gets depends only on which rows are free, not on
        # the order earlier requests were released in (tensor-parallel ranks must pick the same row).
        self._free = list(range(self.batch))  # a heap

    def reset_stats(self) -> None:
        """Zero the step counters (the worker counts served requests only, not its warm-up)."""
        spec = self.spec
        self.stats = Metrics(k=spec.k if spec is not None else 0, mode=spec.mode if spec is not None else "")

    @property
    def active(self) -> int:
        return len(self.slots)

    def admit(self, req_id: str, token_ids: list[int], sampling: SamplingConfig) -> int:
        """Give `req_id` a free row, encode `token_ids` into it and return its first sampled token."""
        if req_id in self.slots:
            raise NeuronInferError(f"request {req_id!r} is already in the batch")
        if not token_ids:
            raise NeuronInferError(f"request {req_id!r} has an empty prompt; give at least one token")
        if len(token_ids) > self.max_context:
            raise NeuronInferError(
                f"request {req_id!r}: prompt of {len(token_ids)} tokens exceeds the artifact's max_context_length="
                f"{self.max_context}; shorten it or recompile with a larger max_context_length"
            )
        if not self._free:
            raise NeuronInferError(
                f"all {self.batch} cache rows are busy: vLLM scheduled more concurrent requests than the artifact's "
                f"batch_size; serve with --max-num-seqs <= {self.batch} or recompile with a larger batch_size"
            )
        slot = Slot(heapq.heappop(self._free), list(token_ids), sampling, make_generator(sampling.seed))
        self.slots[req_id] = slot
        prefill = self.spec.prefill_row if self.spec is not None else self.engine.prefill_row
        logits = prefill(slot.row, slot.tokens)  # [V]
        tok = self._agreed(self._sample([slot], logits.view(1, -1)))[0]  # [1, V]
        slot.tokens.append(tok)
        return tok

    def release(self, req_id: str) -> list[int] | None:
        """Free the row of `req_id` (no-op for unknown ids); return its tokens."""
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return None
        heapq.heappush(self._free, slot.row)
        return slot.tokens

    def decode(self, req_ids: list[str]) -> dict[str, list[int]]:
        """One step over every row; the new tokens of each request in `req_ids` (one, or 1..K+1 speculating)."""
        if not req_ids:
            return {}
        longest = max(len(s.tokens) for s in self.slots.values())
        if longest > self.max_length:
            raise NeuronInferError(
                f"a request reached {longest} tokens, beyond the artifact's max_length={self.max_length}; serve "
                f"with --max-model-len <= {self.max_length}"
            )
        if self.spec is not None:
            rule = self._shared_rule(req_ids)
            seqs = {s.row: s.tokens for s in self.slots.values()}  # every live row: its real tokens are rewritten
            if rule is not None and self.spec.can_speculate(seqs):
                return self._speculate(req_ids, seqs, rule)
        return self._plain(req_ids)

    def _plain(self, req_ids: list[str]) -> dict[str, list[int]]:
        tokens = torch.zeros(self.batch, dtype=torch.int64)  # [B] free rows: token 0 ...
        positions = torch.zeros(self.batch, dtype=torch.int64)  # [B] ... at position 0
        for slot in self.slots.values():
            tokens[slot.row] = slot.tokens[-1]
            positions[slot.row] = len(slot.tokens) - 1  # the pending token's own slot
        step = self.spec.decode_both if self.spec is not None else self.engine.decode
        logits = step(tokens, positions)  # [B, V]
        self.stats.plain_steps += 1
        slots = [self.slots[r] for r in req_ids]
        toks = self._agreed(self._sample(slots, logits[[s.row for s in slots]]))  # logits [n, V] of the scheduled
        for r, tok in zip(req_ids, toks):
            self.slots[r].tokens.append(tok)
        return {r: [tok] for r, tok in zip(req_ids, toks)}

    def _shared_rule(self, req_ids: list[str]) -> SamplingConfig | None:
        """The one sampling rule of the scheduled requests (seed aside), or None when they differ."""
        rules = {(s.temperature, s.top_k, s.top_p) if not s.greedy else "greedy"
                 for s in (self.slots[r].sampling for r in req_ids)}
        if len(rules) != 1:
            return None
        first = self.slots[req_ids[0]].sampling
        return SamplingConfig() if first.greedy else dataclasses.replace(first, seed=None)

    def _speculate(self, req_ids: list[str], seqs: dict[int, list[int]], rule: SamplingConfig
                   ) -> dict[str, list[int]]:
        u = None
        if not rule.greedy:  # each request draws its step's uniforms from its own generator (per-request seed)
            u = torch.zeros(self.batch, uniforms_width(self.spec.k))  # [B, 3K+1]
            for r in req_ids:
                slot = self.slots[r]
                u[slot.row] = torch.rand(u.shape[1], generator=slot.generator)
        got = self.spec.step_tokens(seqs, rule, u)
        self.stats.spec_steps += 1
        out = {}
        for r in req_ids:
            toks = got[self.slots[r].row]
            self.slots[r].tokens.extend(toks)
            self.stats.drafted += self.spec.k
            self.stats.accepted += len(toks) - 1
            out[r] = toks
        return out

    def _agreed(self, tokens: list[int]) -> list[int]:
        """The tokens every rank uses (tensor parallelism: rank 0's); unchanged on one rank."""
        if self.agree is None:
            return tokens
        return self.agree(torch.tensor(tokens, dtype=torch.int64)).tolist()  # [n]

    @staticmethod
    def _sample(slots: list[Slot], logits: torch.Tensor) -> list[int]:
        """All scheduled requests in one call, each with its own settings and generator: logits [n, V] -> n ids."""
        configs = [s.sampling for s in slots]
        return sample_rows(logits, configs, draw_uniforms(configs, [s.generator for s in slots])).tolist()
