"""SpecEngine's per-step API for continuous batching (prefill_row / catch_up / step_tokens / can_speculate).

Requests join and leave rows at different steps (a freed row is reused), some steps are plain one-token steps of
the target alone (as the Runner takes when the batch mixes sampling rules or the gate closes; the draft catches up
before the next speculative step) and the longest request runs into the tail where a speculative block no longer
fits. Greedy (fp32, eager graphs): every request's tokens must equal
target-only `generate_ids` on that request alone, token for token.
"""
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.generate import generate_ids

# (join step, row, prompt, tokens to generate); max_length 96: request 0 ends at 20 + 76 = 96 tokens (the tail)
SCHEDULE = [(0, 0, list(range(5, 25)), 76), (1, 1, [7, 3, 9], 20), (3, 2, list(range(30, 60)), 12),
            (4, 1, [11, 12, 13, 14], 30)]  # the last one reuses row 1 once it is free


def drive(se, plain_every: int):
    """Run SCHEDULE through the per-step API; returns (tokens per request, counters)."""
    seqs, owner, out, pending = {}, {}, {}, list(enumerate(SCHEDULE))
    n = {"spec": 0, "plain": 0, "tail": 0, "multi": 0}
    step = 0
    while pending or seqs:
        if seqs:
            if step % plain_every == 0 or not se.can_speculate(seqs):
                n["tail" if not se.can_speculate(seqs) else "plain"] += 1
                tokens, pos = (torch.zeros(3, dtype=torch.int64) for _ in range(2))  # [B] each
                for r, s in seqs.items():
                    tokens[r], pos[r] = s[-1], len(s) - 1
                logits = se.target.decode(tokens, pos)  # [B, V]
                new = {r: [int(logits[r].argmax())] for r in seqs}
            else:
                new = se.step_tokens(seqs, SamplingConfig())
                n["spec"] += 1
                n["multi"] += sum(len(t) > 1 for t in new.values())
            for r, toks in new.items():
                seqs[r].extend(toks)
        for item in list(pending):  # decode first, then admit (the step writes every row)
            i, (join, row, prompt, _) = item
            if join <= step and row not in seqs:
                seqs[row], owner[row] = list(prompt) + [int(se.prefill_row(row, prompt).argmax())], i
                pending.remove(item)
        for r in list(seqs):
            i = owner[r]
            prompt, want = SCHEDULE[i][2], SCHEDULE[i][3]
            if len(seqs[r]) - len(prompt) >= want:
                out[i] = seqs.pop(r)[len(prompt):][:want]  # a block may overshoot; the consumer trims
        step += 1
    return out, n


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_continuous_batching_steps_equal_target_alone(spec_engine, mode):
    se = spec_engine(draft="layers1", k=3, mode=mode, batch_size=3)
    want = {}
    for i, (_, _, prompt, n) in enumerate(SCHEDULE):
        res, _ = generate_ids(se.target, [prompt], n, ignore_eos=True)  # reference first: it reuses the caches
        want[i] = res[0].token_ids
    se.target.bind_stripes()  # driven without a runner: each row its own blocks
    got, n = drive(se, plain_every=4)
    assert got == want
    assert n["spec"] > 0 and n["plain"] > 0 and n["tail"] > 0 and n["multi"] > 0  # every path really taken


def test_step_tokens_needs_a_first_token(spec_engine):
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=3)
    with pytest.raises(NeuronInferError, match="prefill_row, then sample"):
        se.step_tokens({0: [5]}, SamplingConfig())


def plain_steps(se, seq: list[int], n: int) -> None:
    """n plain one-token steps of row 0 through the target alone (the draft cache is not written)."""
    for _ in range(n):
        tokens, pos = (torch.zeros(3, dtype=torch.int64) for _ in range(2))  # [B] each
        tokens[0], pos[0] = seq[-1], len(seq) - 1
        seq.append(int(se.target.decode(tokens, pos)[0].argmax()))


def assert_draft_cache_holds(se, seq: list[int], upto: int) -> None:
    """Row 0's draft K/V at positions < upto equal a fresh draft prefill of the same tokens into row 1."""
    se.draft.prefill_row(1, seq[:upto])
    for a, b in zip(se.draft.slot_kv(0), se.draft.slot_kv(1)):  # K, V [L, Hkv, S, D] of slots 0 and 1
        # fp32, one-token vs whole-prompt graphs: same math, different reduction order -> ~1e-6 differences
        torch.testing.assert_close(a[:, :, :upto], b[:, :, :upto], rtol=1e-4, atol=1e-5)


# a 5-token prompt, then 3 plain steps: a lag of 3 tokens, one 8-token catch-up pass (two two-token passes with
# an artifact without the 8-token graphs); 14: two 8-token passes, 18: a lag of 18 > PREFILL_LAG, positions 0..21
# re-encoded by one pass of the draft's context graph
@pytest.mark.parametrize(("plain", "wide", "want_passes"), [(3, True, 1), (3, False, 2), (14, True, 2),
                                                             (14, False, 7), (18, True, 1)])
def test_catch_up_writes_what_plain_steps_left_out(spec_engine, monkeypatch, plain, wide, want_passes):
    """Greedy output cannot show a stale draft cache (it only lowers acceptance), so compare the cache itself: after
    the prompt and plain steps of the target alone, `catch_up` must leave the draft's K/V of row 0 equal to a fresh
    draft prefill of the same tokens (positions 0..len-3: the speculative step writes the last two)."""
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=3)
    if not wide:
        monkeypatch.setattr(se.draft, "graphs", {n: g for n, g in se.draft.graphs.items() if "_t8_" not in n})
    se.target.bind_stripes()  # driven without a runner: each row its own blocks
    prompt = [5, 9, 2, 7, 11]
    seq = prompt + [int(se.prefill_row(0, prompt).argmax())]
    assert se.catch_up({0: seq}) == (1, 4)  # the prompt: one pass of the draft's context graph, positions 0..3
    plain_steps(se, seq, plain)
    assert se.catch_up({0: seq}) == (want_passes, plain)  # the plain steps' tokens were missing
    assert_draft_cache_holds(se, seq, len(seq) - 2)
    assert se.catch_up({0: seq}) == (0, 0)  # nothing lags any more


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_catch_up_after_a_fully_accepted_block(spec_engine, mode):
    """A speculative step whose K drafts are all accepted never runs its last draft through the draft model, and a
    step's tokens may be discarded by the caller (a row that was not scheduled): `drafted` must record only what
    the draft really wrote and agrees with the row's tokens, so catch_up fills exactly the rest."""
    se = spec_engine(draft="full", k=3, mode=mode, batch_size=3)  # the draft is the target: every draft accepted
    se.target.bind_stripes()
    prompt = list(range(5, 25))
    seq = prompt + [int(se.prefill_row(0, prompt).argmax())]
    got = se.step_tokens({0: seq}, SamplingConfig())[0]
    assert len(got) == 4  # the whole block accepted
    assert se.drafted[0] == seq + got[:2]  # the drafts run through the draft model: K - 1 of them
    seq += got
    plain_steps(se, seq, 2)
    se.catch_up({0: seq})
    assert_draft_cache_holds(se, seq, len(seq) - 2)
    discarded = se.step_tokens({0: seq}, SamplingConfig())[0]  # the caller keeps none of these tokens
    assert len(discarded) == 4
    plain_steps(se, seq, 3)  # other tokens than the discarded ones (the target alone, greedy: the same here) ...
    seq[-3:] = [t + 1 for t in seq[-3:]]  # ... so make them differ, as a sampled plain step could
    se.catch_up({0: seq})
    assert_draft_cache_holds(se, seq, len(seq) - 2)
