"""SpecEngine's per-step API for continuous batching (prefill_row / step_tokens / decode_both / can_speculate).

Requests join and leave rows at different steps (a freed row is reused), some steps are plain one-token steps
(`decode_both`, as the vLLM runner does when the batch mixes sampling rules) and the longest request runs into the
tail where a speculative block no longer fits. Greedy (fp32, eager graphs): every request's tokens must equal
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
                tokens, pos, prev = (torch.zeros(3, dtype=torch.int64) for _ in range(3))  # [B] each
                for r, s in seqs.items():
                    tokens[r], pos[r], prev[r] = s[-1], len(s) - 1, s[-2]
                logits = se.decode_both(tokens, pos, prev)  # [B, V]
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


def test_decode_both_writes_the_draft_cache(spec_engine):
    """Greedy output cannot show a stale draft cache (it only lowers acceptance), so compare the cache itself: plain
    steps must leave the draft's K/V of row 0 equal to a fresh draft prefill of the same tokens into row 1."""
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=3)
    se.target.bind_stripes()  # driven without a runner: each row its own blocks
    prompt = list(range(5, 25))
    seq = prompt + [int(se.prefill_row(0, prompt).argmax())]
    for _ in range(5):
        tokens, pos, prev = (torch.zeros(3, dtype=torch.int64) for _ in range(3))  # [B] each
        tokens[0], pos[0], prev[0] = seq[-1], len(seq) - 1, seq[-2]
        seq.append(int(se.decode_both(tokens, pos, prev)[0].argmax()))
    cached = len(seq) - 1  # the newest token is not in the cache yet
    se.prefill_row(1, seq[:cached])
    for a, b in zip(se.draft.slot_kv(0), se.draft.slot_kv(1)):  # K, V [L, Hkv, S, D] of slots 0 and 1
        # fp32, one-token vs whole-prompt graphs: same math, different reduction order -> ~1e-6 differences
        torch.testing.assert_close(a[:, :, :cached], b[:, :, :cached], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_plain_step_after_a_fully_accepted_block_fills_the_draft_cache(spec_engine, mode):
    """A speculative step whose K drafts are all accepted never runs its last draft through the draft model: the
    next step writes that slot. When the next step is plain, `decode_both` must write it (else the draft attends to
    a stale slot for the rest of the sequence, which lowers acceptance, unseen by greedy output)."""
    se = spec_engine(draft="full", k=3, mode=mode, batch_size=3)  # the draft is the target: every draft accepted
    se.target.bind_stripes()
    prompt = list(range(5, 25))
    seq = prompt + [int(se.prefill_row(0, prompt).argmax())]
    got = se.step_tokens({0: seq}, SamplingConfig())[0]
    assert len(got) == 4  # the whole block accepted
    seq += got
    for _ in range(2):
        tokens, pos, prev = (torch.zeros(3, dtype=torch.int64) for _ in range(3))  # [B] each
        tokens[0], pos[0], prev[0] = seq[-1], len(seq) - 1, seq[-2]
        seq.append(int(se.decode_both(tokens, pos, prev)[0].argmax()))
    cached = len(seq) - 1
    se.prefill_row(1, seq[:cached])
    for a, b in zip(se.draft.slot_kv(0), se.draft.slot_kv(1)):  # K, V [L, Hkv, S, D] of slots 0 and 1
        torch.testing.assert_close(a[:, :, :cached], b[:, :, :cached], rtol=1e-4, atol=1e-5)
