"""Sample logprobs in the layout of vLLM's `LogprobsLists` (v1 engine), from the runtime's per-token records.

No vLLM types here (the worker wraps the arrays), so the layout is unit-tested without vLLM. vLLM's own sampler
returns, per generated token, one row `[sampled token, top-1, ..., top-n]` of ids and of logprobs, plus the sampled
token's rank; n is the largest number asked for in the step and vLLM keeps each request's first (own n) + 1 entries.
`cu` gives each request's first row, so requests may carry 0 rows (no logprobs asked, or a prompt still arriving)
or several (speculative blocks, although sequences asking for logprobs always take plain steps).
"""
from __future__ import annotations

import numpy as np

PAD_ID, PAD_LOGPROB = 0, float("-inf")  # fills rows of requests asking fewer than the step's largest n (never read)


def logprobs_arrays(per_request: list[list[dict]]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None:
    """Records per request (in the step's request order; see runtime `token_logprobs`) -> (token ids [R, n+1] int32,
    logprobs [R, n+1] float32, sampled ranks [R] int64, cu [requests + 1]) over the R records in all, or None when
    the step has no record."""
    records = [rec for recs in per_request for rec in recs]
    if not records:
        return None
    width = 1 + max(len(rec["top"]) for rec in records)
    ids = np.full((len(records), width), PAD_ID, dtype=np.int32)  # [R, n+1]
    lps = np.full((len(records), width), PAD_LOGPROB, dtype=np.float32)  # [R, n+1]
    ranks = np.empty(len(records), dtype=np.int64)  # [R]
    for r, rec in enumerate(records):
        row = [(rec["token_id"], rec["logprob"]), *rec["top"]]
        ids[r, : len(row)] = [i for i, _ in row]
        lps[r, : len(row)] = [v for _, v in row]
        ranks[r] = rec["rank"]
    cu = np.concatenate([[0], np.cumsum([len(recs) for recs in per_request])]).tolist()
    return ids, lps, ranks, cu


def prompt_logprobs_arrays(records: list[dict], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One request's prompt records (one per prompt token after the first) -> (token ids [P-1, n+1] int32, logprobs
    [P-1, n+1] float32, ranks [P-1] int32): vLLM's prompt `LogprobsTensors` layout, each row [prompt token, top-1,
    ..., top-n] (a one-token prompt: zero rows)."""
    ids = np.full((len(records), n + 1), PAD_ID, dtype=np.int32)  # [P-1, n+1]
    lps = np.full((len(records), n + 1), PAD_LOGPROB, dtype=np.float32)  # [P-1, n+1]
    ranks = np.empty(len(records), dtype=np.int32)  # [P-1]
    for r, rec in enumerate(records):
        row = [(rec["token_id"], rec["logprob"]), *rec["top"][:n]]
        ids[r, : len(row)] = [i for i, _ in row]
        lps[r, : len(row)] = [v for _, v in row]
        ranks[r] = rec["rank"]
    return ids, lps, ranks
