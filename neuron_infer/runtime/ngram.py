"""Prompt-lookup (n-gram) drafts and the decision whether a step speculates: pure functions, no tensors.

Draft rule (`propose`): match the last n tokens of a sequence (prompt + output so far) against its earlier tokens,
for n = ngram_size, ngram_size - 1, ..., 1 (the longest suffix first); at the first n with a match, the draft is
the (up to k) tokens that followed its **most recent** earlier occurrence. No match at any n: no draft (the step is
a plain step for that sequence).

Speculation policy (`plan_step`): each sequence keeps an EWMA of its acceptance rate a (accepted / drafted) and
the number of steps since it last drafted. With one target pass over k+1 positions costing `cost_ratio` plain
steps (measured at run time), and drafts accepted independently with probability a, a verify step yields
E(k, a) = 1 + a + ... + a^k tokens for that sequence. Per sequence
    k = min(draft length, adapt_k(a, K))     adapt_k: about the expected number of accepted tokens a / (1 - a), plus one
    k = 0 when E(k, a) < cost_ratio          (it would not pay on its own), except every `probe_every` idle steps,
                                              when it drafts again (a probe), so a sequence whose text turns
                                              repetitive resumes speculating.
The step speculates when sum(E) over the scheduled sequences (1 for those with k = 0) exceeds cost_ratio * n, or
when a probe is due; otherwise every k is 0 and the step is plain.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EWMA_ALPHA = 0.3  # weight of the newest step in a sequence's acceptance rate
PRIOR_RATE = 0.5  # acceptance rate assumed before a sequence's first draft
PROBE_EVERY = 16  # idle steps after which a sequence drafts again regardless of its rate


def propose(tokens: Sequence[int], ngram_size: int, k: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` by prompt lookup (see the module docstring); [] when no match."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(ngram_size, length - 1), 0, -1):
        suffix = list(tokens[length - n:])
        head = suffix[0]
        for i in range(length - n - 1, -1, -1):  # most recent occurrence first; never the suffix itself
            if tokens[i] == head and list(tokens[i: i + n]) == suffix:
                return list(tokens[i + n: i + n + k])
    return []


def expected_tokens(k: int, rate: float) -> float:
    """Tokens a verify step with k drafts yields when each draft is accepted with probability `rate`."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def adapt_k(rate: float, k_max: int) -> int:
    """Draft length for a sequence with acceptance rate `rate`: its expected accepted run + 1, in 1..k_max."""
    if rate >= 1.0:
        return k_max
    run = rate / (1.0 - rate)
    return max(1, min(k_max, math.ceil(run) + 1))


@dataclass(frozen=True)
class RowView:
    """What the policy sees of one scheduled sequence."""

    draft_len: int  # tokens the lookup found (0: no match)
    rate: float  # EWMA acceptance rate of its drafts
    idle: int  # steps since it last drafted


def plan_step(rows: Sequence[RowView], k_max: int, cost_ratio: float, probe_every: int = PROBE_EVERY) -> list[int]:
    """Draft length per row for this step; all zeros means a plain step (see the module docstring)."""
    ks, probe = [], False
    for r in rows:
        k = min(r.draft_len, adapt_k(r.rate, k_max))
        due = k > 0 and r.idle >= probe_every
        if k > 0 and expected_tokens(k, r.rate) < cost_ratio and not due:
            k = 0
        probe = probe or due
        ks.append(k)
    gain = sum(expected_tokens(k, r.rate) if k else 1.0 for k, r in zip(ks, rows))
    if probe or gain > cost_ratio * len(rows):
        return ks
    return [0] * len(rows)


@dataclass
class SeqState:
    """A sequence's adaptive state (kept by the speculation engine, per sequence)."""

    rate: float = PRIOR_RATE
    idle: int = 0

    def update(self, drafted: int, accepted: int) -> None:
        """After a step: `drafted` tokens proposed to it (0: it did not draft), `accepted` of them kept."""
        if drafted == 0:
            self.idle += 1
            return
        self.idle = 0
        self.rate = (1.0 - EWMA_ALPHA) * self.rate + EWMA_ALPHA * (accepted / drafted)
