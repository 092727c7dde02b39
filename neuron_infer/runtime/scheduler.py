"""The Scheduler: admits waiting sequences into free KV-cache rows, releases finished ones, and says who runs.

The cache has `batch_size` rows; a running sequence owns one. The lowest free row is handed out first, so the row a
sequence gets depends only on which rows are free, never on the order earlier sequences left in (tensor-parallel
ranks, fed the same decisions, pick the same rows).
"""
from __future__ import annotations

import heapq
from collections import deque

from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.sequence import Sequence


class Scheduler:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free = list(range(batch_size))  # a heap of free rows

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free rows (first come, first served) -> the newly admitted ones."""
        new = []
        while self.waiting and self._free:
            new.append(self._admit_first())
        return new

    def admit_now(self, seq: Sequence) -> None:
        """Admit one sequence at once (the vLLM worker: vLLM's scheduler already decided), or fail clearly."""
        if not self._free:
            raise NeuronInferError(
                f"all {self.batch_size} cache rows are busy: vLLM scheduled more concurrent requests than the "
                f"artifact's batch_size; serve with --max-num-seqs <= {self.batch_size} or recompile with a larger "
                "batch_size")
        self.waiting.appendleft(seq)
        self._admit_first()

    def _admit_first(self) -> Sequence:
        seq = self.waiting.popleft()
        seq.row = heapq.heappop(self._free)
        self.running.append(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        """Free the row of a running sequence."""
        self.running.remove(seq)
        heapq.heappush(self._free, seq.row)
        seq.row = None

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for s in done:
            self.release(s)
        return done
