"""The Scheduler: admits waiting sequences into free batch slots and KV-cache blocks, releases finished ones.

The static batch has `batch_size` slots; a running sequence owns one (its batch row in full-batch graphs) and a list
of cache blocks (runtime/blocks.py). The lowest free slot is handed out first, so the slot a sequence gets depends
only on which slots are free, never on the order earlier sequences left in (tensor-parallel ranks, fed the same
decisions, pick the same slots and blocks).

A sequence is admitted only when the pool can promise every block it may write: min(max_length, prompt +
max_new_tokens + lookahead) positions (lookahead: the K speculative positions past its newest token), less the
blocks of its prompt found in the prefix cache. Otherwise it waits (first come, first served) until finishing
sequences give blocks back. Blocks are taken as the sequence grows (`grow`).
"""
from __future__ import annotations

import heapq
from collections import deque

from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.blocks import BlockPool, block_hashes, blocks_for
from neuron_infer.runtime.sequence import Sequence


class Scheduler:
    def __init__(self, batch_size: int, pool: BlockPool, lookahead: int = 0, max_length: int | None = None):
        self.batch_size, self.pool, self.lookahead, self.max_length = batch_size, pool, lookahead, max_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free = list(range(batch_size))  # a heap of free slots

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots while their blocks fit (first come, first served) -> the newly
        admitted ones."""
        new = []
        while self.waiting and self._free and self._fits(self.waiting[0]):
            new.append(self._admit_first())
        if self.waiting and not self.running and not new:
            raise NeuronInferError(f"a request of {len(self.waiting[0])} tokens does not fit the KV cache of "
                                   f"{self.pool.usable} blocks even alone; raise --kv-cache-gib")
        return new

    def admit_now(self, seq: Sequence) -> None:
        """Admit one sequence at once (the vLLM worker: vLLM's scheduler already decided), or fail clearly."""
        if not self._free:
            raise NeuronInferError(
                f"all {self.batch_size} batch slots are busy: vLLM scheduled more concurrent requests than the "
                f"artifact's batch_size; serve with --max-num-seqs <= {self.batch_size} or recompile with a larger "
                "batch_size")
        if not self._fits(seq):
            raise NeuronInferError(
                f"the KV cache has {self.pool.available} free blocks of {self.pool.block_size} tokens, too few for "
                f"another request of up to {self._bound(seq)} tokens; serve with a larger --kv-cache-gib or fewer "
                "--max-num-seqs")
        self.waiting.appendleft(seq)
        self._admit_first()

    # ---- blocks --------------------------------------------------------------------------------------------------
    def _bound(self, seq: Sequence) -> int:
        """Positions `seq` may ever write."""
        limit = self.max_length or seq.stop.max_length or len(seq) + self.lookahead + 1
        new = seq.stop.max_new_tokens if seq.stop.max_new_tokens is not None else limit
        return min(limit, len(seq) + new + self.lookahead)

    def _hits(self, seq: Sequence, count: bool) -> list[int]:
        """Cached blocks of the prompt's full blocks, leaving at least its last token to encode."""
        return self.pool.lookup(block_hashes(seq.tokens[: len(seq) - 1], self.pool.block_size), count)

    def _fits(self, seq: Sequence) -> bool:
        hits = self._hits(seq, count=False)
        idle_hits = sum(1 for b in hits if self.pool.refs[b] == 0)  # leave the free list when taken
        return blocks_for(self._bound(seq), self.pool.block_size) - len(hits) <= self.pool.available - idle_hits

    def _admit_first(self) -> Sequence:
        seq = self.waiting.popleft()
        hits = self._hits(seq, count=True)
        for b in hits:
            self.pool.take(b)
        seq.row, seq.blocks, seq.cached = heapq.heappop(self._free), hits, len(hits) * self.pool.block_size
        seq.reserved = blocks_for(self._bound(seq), self.pool.block_size) - len(hits)
        self.pool.reserved += seq.reserved
        self.running.append(seq)
        return seq

    def grow(self, seq: Sequence, positions: int) -> None:
        """Give `seq` blocks for its first `positions` positions (from its promise)."""
        need = blocks_for(min(positions, self._bound(seq)), self.pool.block_size) - len(seq.blocks)
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
            seq.reserved -= 1
            self.pool.reserved -= 1

    def cache_blocks(self, seq: Sequence) -> None:
        """Record the full blocks of `seq`'s cached tokens (all but its newest) in the prefix cache: after its prefill,
        and when it leaves (its output's blocks too: a later prompt that repeats prompt + output, a chat's next
        turn, finds them)."""
        if not self.pool.prefix_caching:
            return  # no hashing per finished sequence when nothing would be recorded
        for block, h in zip(seq.blocks, block_hashes(seq.tokens[: len(seq) - 1], self.pool.block_size)):
            self.pool.register(block, h)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Free the slot and blocks of a running sequence (`cache`: its tokens are all in its blocks, so its full
        blocks enter the prefix cache; not for a sequence whose prompt is still being encoded)."""
        if cache:
            self.cache_blocks(seq)
        self.running.remove(seq)
        heapq.heappush(self._free, seq.row)
        self.pool.release(seq.blocks)
        self.pool.reserved -= seq.reserved
        seq.row, seq.blocks, seq.reserved = None, [], 0

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for s in done:
            self.release(s)
        return done
