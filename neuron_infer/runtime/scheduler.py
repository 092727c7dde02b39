"""The Scheduler: admits waiting sequences into free batch slots and KV-cache blocks, releases finished ones.

The static batch has `batch_size` slots; a running sequence owns one (its batch row in full-batch graphs) and a list
of cache blocks (runtime/blocks.py). The lowest free slot is handed out first, so the slot a sequence gets depends
only on which slots are free, never on the order earlier sequences left in (tensor-parallel ranks, fed the same
decisions, pick the same slots and blocks).

A sequence is admitted only when the pool can promise every block it may write: min(max_length, prompt +
max_new_tokens + lookahead) positions (lookahead: the K speculative positions past its newest token), less the
blocks of its prompt found in the prefix cache. Otherwise it waits (first come, first served) until finishing
sequences give blocks back. Blocks are taken as the sequence grows (`grow`).

With `caller_blocks` (the vLLM worker), the caller's block manager owns the blocks: vLLM's scheduler allocates,
shares (its prefix caching), preempts and frees them, and hands each sequence its block ids, which `admit_now` and
`extend` record as the sequence's block table. The pool then takes no part: nothing is reserved, grown, hashed or
freed here.
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
        self.caller_blocks = False  # True: the caller hands out every block (admit_now / extend), see above

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

    def admit_now(self, seq: Sequence, blocks: list[int], computed: int) -> None:
        """Admit one sequence at once into the blocks its caller allocated (`caller_blocks`: vLLM's scheduler
        decided; its first `computed` positions are already in `blocks`, vLLM's prefix-cache hit), or fail clearly."""
        if not self._free:
            raise NeuronInferError(
                f"all {self.batch_size} batch slots are busy: vLLM scheduled more concurrent requests than the "
                f"artifact's batch_size; serve with --max-num-seqs <= {self.batch_size} or recompile with a larger "
                "batch_size")
        if not 0 <= computed < len(seq) or computed % self.pool.block_size:
            raise NeuronInferError(f"a request of {len(seq)} tokens cannot start at position {computed}: cached "
                                   f"positions come in whole blocks of {self.pool.block_size} and leave a token")
        self._check_blocks(blocks)  # before the slot is taken: a refused request leaves nothing behind
        seq.row, seq.blocks, seq.cached, seq.reserved = heapq.heappop(self._free), list(blocks), computed, 0
        self.running.append(seq)

    def extend(self, seq: Sequence, blocks: list[int]) -> None:
        """Append the caller's newly allocated `blocks` to `seq`'s block table (`caller_blocks`)."""
        self._check_blocks(blocks)
        seq.blocks.extend(blocks)

    def _check_blocks(self, blocks: list[int]) -> None:
        bad = [b for b in blocks if not 0 < b < self.pool.num_blocks]
        if bad:
            raise NeuronInferError(f"block id {bad[0]} is outside the KV cache's blocks 1..{self.pool.num_blocks - 1}")

    def has_room(self, seqs: list[Sequence], positions: int) -> bool:
        """Whether every sequence holds blocks for `positions` positions past its pending token's (a speculative
        step writes them). Always, with the pool (`grow` takes them); the caller's blocks may end sooner."""
        if not self.caller_blocks:
            return True
        bs = self.pool.block_size
        return all(len(s.blocks) * bs >= len(s) + positions for s in seqs)

    # ---- blocks --------------------------------------------------------------------------------------------------
    def _bound(self, seq: Sequence) -> int:
        """Positions `seq` may ever write."""
        limit = self.max_length or seq.stop.max_length or len(seq) + self.lookahead + 1
        new = seq.stop.max_new_tokens if seq.stop.max_new_tokens is not None else limit
        return min(limit, len(seq) + new + self.lookahead)

    def _hits(self, seq: Sequence, count: bool) -> list[int]:
        """Cached blocks of the prompt's full blocks, leaving at least its last token to encode (none for a sequence
        scoring its prompt: every position's logits are needed, as vLLM skips reading the prefix cache then)."""
        if seq.prompt_logprobs is not None:
            return []
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
        """Give `seq` blocks for its first `positions` positions (from its promise; the caller's blocks: nothing to
        do)."""
        if self.caller_blocks:
            return
        need = blocks_for(min(positions, self._bound(seq)), self.pool.block_size) - len(seq.blocks)
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
            seq.reserved -= 1
            self.pool.reserved -= 1

    def cache_blocks(self, seq: Sequence) -> None:
        """Record the full blocks of `seq`'s cached tokens (all but its newest) in the prefix cache: after its prefill,
        and when it leaves (its output's blocks too: a later prompt that repeats prompt + output, a chat's next
        turn, finds them)."""
        if not self.pool.prefix_caching or self.caller_blocks:
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
        if not self.caller_blocks:
            self.pool.release(seq.blocks)
            self.pool.reserved -= seq.reserved
        seq.row, seq.blocks, seq.reserved = None, [], 0

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for s in done:
            self.release(s)
        return done
