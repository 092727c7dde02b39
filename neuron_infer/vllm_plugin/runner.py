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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.sampling import make_generator, sample


@dataclass
class Slot:
    """One request in the batch: its cache row, all its tokens (prompt + generated; the last one is not yet in
    the cache) and its own sampler state."""

    row: int
    tokens: list[int]
    sampling: SamplingConfig
    generator: torch.Generator


class SlotRunner:
    """Maps request ids to cache rows and produces one token per scheduled request per step."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.batch = engine.build.batch_size
        self.max_context = engine.build.max_context_length
        self.max_length = engine.build.max_length
        self.slots: dict[str, Slot] = {}
        self._free = list(range(self.batch - 1, -1, -1))  # pop() hands out row 0 first

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
        slot = Slot(self._free.pop(), list(token_ids), sampling, make_generator(sampling.seed))
        self.slots[req_id] = slot
        logits = self.engine.prefill_row(slot.row, slot.tokens)  # [V]
        return self._take(slot, logits.view(1, -1))

    def release(self, req_id: str) -> list[int] | None:
        """Free the row of `req_id` (no-op for unknown ids); return its tokens."""
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return None
        self._free.append(slot.row)
        return slot.tokens

    def decode(self, req_ids: list[str]) -> dict[str, int]:
        """One token-generation step over every row; sample the next token of each request in `req_ids`."""
        if not req_ids:
            return {}
        tokens = torch.zeros(self.batch, dtype=torch.int64)  # [B] free rows: token 0 ...
        positions = torch.zeros(self.batch, dtype=torch.int64)  # [B] ... at position 0
        for slot in self.slots.values():
            tokens[slot.row] = slot.tokens[-1]
            positions[slot.row] = len(slot.tokens) - 1  # the pending token's own slot
        if int(positions.max()) >= self.max_length:
            raise NeuronInferError(
                f"a request reached {int(positions.max()) + 1} tokens, beyond the artifact's max_length="
                f"{self.max_length}; serve with --max-model-len <= {self.max_length}"
            )
        logits = self.engine.decode(tokens, positions)  # [B, V]
        out = {}
        for req_id in req_ids:
            slot = self.slots[req_id]
            out[req_id] = self._take(slot, logits[slot.row : slot.row + 1])  # [1, V]
        return out

    @staticmethod
    def _take(slot: Slot, logits: torch.Tensor) -> int:
        tok = int(sample(logits, slot.sampling, slot.generator)[0])
        slot.tokens.append(tok)
        return tok
