"""Prompt-lookup (n-gram) drafts and the decision whether a step speculates: pure functions, no tensors.

Draft rule (`propose`): the earlier occurrences of the sequence's last n tokens (prompt + output so far), for the
longest n <= ngram_size that has any (the VOTERS most recent of them), vote on how it continues. Each weighs 2^c, c
being the number of tokens (up to CONTEXT_CAP) before and including it that equal the sequence's last c tokens: one
more token of shared context counts as much as a second occurrence, so a sequence copying a passage follows that
passage, and among equal contexts the most frequent continuation wins. The draft is built token by token: the next
token is the one the occurrences still agreeing with the draft so far give the most weight (ties: the most recent
occurrence's), up to k tokens. No earlier occurrence of the last token: no draft (the step is a plain step for that
sequence). Following the most recent occurrence alone drafts fewer accepted tokens on SmolLM2's outputs
(docs/speculation.md replays both).

Speculation policy (`plan_step`): one verify pass computes K+1 positions whatever the number of drafts, so a
shorter draft saves nothing; what adapts per sequence is whether it drafts at all. Each sequence keeps the mean
number of draft tokens accepted over its last WINDOW drafts (`accepted`; before its first, one pseudo-draft of
PRIOR_ACCEPTED) and the number of steps since it last drafted. Prompt lookup is bursty - while the output copies its
input whole drafts are accepted, then none - so the policy estimates that count directly rather than a per-token
rate (a rate a with independent acceptances predicts 1 + a + ... + a^k tokens, far below what a copying sequence
gets), and over a window long enough to span a run of misses between copied stretches: a short memory would
decline the drafts right after a few misses, often the first of the next copied stretch (docs/speculation.md replays
both on SmolLM2's outputs). With one verify step costing `cost_ratio` plain steps (measured at run time),
a sequence with a draft of d tokens expects E = 1 + min(accepted, d) tokens from it, and
    k = d       when E >= cost_ratio, or when `probe_every` steps have passed since it last drafted (a probe, so a
                sequence whose text turns repetitive resumes speculating);
    k = 0       otherwise (no draft, or it would not pay): that sequence takes a plain step's token.
The step speculates when the sum of E over the scheduled sequences (1 for those with k = 0) exceeds
cost_ratio * n, or when a probe is due; otherwise every k is 0 and the step is plain.
A draft the policy declines is still scored, for free: the tokens the plain steps then produce show how many of
its tokens a verify step would have accepted (the matching prefix; for greedy decoding exactly that, under sampling
the same expectation for its first token), and that count updates the estimate (`SeqState.watch` / `observe`).
So a sequence whose output starts copying its input is noticed at once, without waiting for a probe.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

WINDOW = 24  # a sequence's latest drafts (verified, or scored for free) its accepted-drafts estimate averages
PRIOR_ACCEPTED = 2.0  # one pseudo-draft with this many tokens accepted, in the window before a sequence's first draft
PROBE_EVERY = 16  # idle steps after which a sequence drafts again regardless of its estimate
CONTEXT_CAP = 16  # shared-context tokens an occurrence's weight (2^c) counts at most
VOTERS = 64  # the most recent occurrences of the matched suffix that vote (bounds the host work on repetitive text)


def propose(tokens: Sequence[int], ngram_size: int, k: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` by prompt lookup (see the module docstring); [] when no match."""
    if k <= 0 or len(tokens) < 2:
        return []
    ends = _earlier(tokens, tokens[-1])
    if not ends:
        return []
    seen, full = [], 0  # (occurrence, shared context), most recent first
    for e in reversed(ends):
        seen.append((e, _shared_context(tokens, e)))
        full += seen[-1][1] >= ngram_size
        if full == VOTERS:  # n = ngram_size and these are its VOTERS most recent occurrences: older ones cannot vote
            break
    n = min(ngram_size, max(c for _, c in seen))  # the longest suffix <= ngram_size found earlier
    votes = [(e + 1, 1 << c) for e, c in reversed(seen) if c >= n][-VOTERS:]  # (next position, weight), in order
    return _heaviest_path(tokens, votes, k)


def _earlier(tokens: Sequence[int], token: int) -> list[int]:
    """Positions of `token` before the sequence's last one, in order (Sequence.index scans at C speed)."""
    ends, i, last = [], -1, len(tokens) - 1
    while True:
        try:
            i = tokens.index(token, i + 1, last)
        except ValueError:
            return ends
        ends.append(i)


def _shared_context(tokens: Sequence[int], e: int) -> int:
    """How many tokens ending at position e equal the sequence's last ones (>= 1: tokens[e] itself), capped."""
    last = len(tokens) - 1
    c = 1
    while c < CONTEXT_CAP and c <= e and tokens[e - c] == tokens[last - c]:
        c += 1
    return c


def _heaviest_path(tokens: Sequence[int], votes: list[tuple[int, int]], k: int) -> list[int]:
    """Token by token, the continuation the votes (position, weight) still agreeing with it weigh most."""
    draft, length = [], len(tokens)
    while len(draft) < k:
        votes = [(p, w) for p, w in votes if p < length]
        if not votes:
            break
        nexts = [tokens[p] for p, _ in votes]
        token = nexts[-1]
        if nexts.count(token) < len(nexts):  # the votes disagree: weigh them
            weight: dict[int, int] = {}
            for t, (_, w) in zip(nexts, votes):
                weight[t] = weight.get(t, 0) + w
            best = max(weight.values())
            token = next(t for t in reversed(nexts) if weight[t] == best)  # ties: the most recent
        draft.append(token)
        votes = [(p + 1, w) for p, w in votes if tokens[p] == token]
    return draft


@dataclass(frozen=True)
class RowView:
    """What the policy sees of one scheduled sequence."""

    draft_len: int  # tokens the lookup found (0: no match)
    accepted: float  # its mean draft tokens accepted per draft (SeqState.accepted)
    idle: int  # steps since it last drafted

    def expected(self) -> float:
        """Tokens a verify step with this row's draft yields it (1: no draft)."""
        return 1.0 + min(self.accepted, self.draft_len)


def plan_step(rows: Sequence[RowView], cost_ratio: float, probe_every: int = PROBE_EVERY) -> list[int]:
    """Draft length per row for this step; all zeros means a plain step (see the module docstring)."""
    ks, probe = [], False
    for r in rows:
        due = r.draft_len > 0 and r.idle >= probe_every
        ks.append(r.draft_len if due or r.expected() >= cost_ratio else 0)
        probe = probe or due
    gain = sum(r.expected() if k else 1.0 for k, r in zip(ks, rows))
    if probe or gain > cost_ratio * len(rows):
        return ks
    return [0] * len(rows)


@dataclass
class SeqState:
    """A sequence's adaptive state (kept by the speculation engine, per sequence)."""

    recent: deque[float] = field(default_factory=lambda: deque([PRIOR_ACCEPTED], maxlen=WINDOW))  # accepted/draft
    idle: int = 0
    shadow: tuple[int, list[int]] | None = None  # a draft it did not verify: (position of its first token, draft)

    @property
    def accepted(self) -> float:
        """Mean draft tokens accepted per draft over the window."""
        return sum(self.recent) / len(self.recent)

    def update(self, drafted: int, accepted: int) -> None:
        """After a step: `drafted` tokens proposed to it (0: it did not draft), `accepted` of them kept."""
        if drafted == 0:
            self.idle += 1
            return
        self.idle = 0
        self.shadow = None  # a verified draft measures those positions itself
        self._learn(accepted)

    def watch(self, start: int, draft: list[int]) -> None:
        """A draft this step did not verify (its first token would sit at `start`): `observe` scores it for free
        against the tokens that follow, as the drafts a verify step would have accepted."""
        if self.shadow is None and draft:
            self.shadow = (start, list(draft))

    def observe(self, tokens: Sequence[int]) -> None:
        """Score the watched draft once the tokens decide it: a mismatch, or every draft token matched."""
        if self.shadow is None:
            return
        start, draft = self.shadow
        seen = list(tokens[start: start + len(draft)])
        hits = next((i for i, (a, b) in enumerate(zip(seen, draft)) if a != b), len(seen))
        if hits < len(seen) or len(seen) == len(draft):
            self.shadow, self.idle = None, 0
            self._learn(hits)

    def _learn(self, accepted: int) -> None:
        self.recent.append(accepted)
