"""Lossless speculative sampling on a tiny model: the emitted tokens are distributed as the target's.

Method: B rows share one context (prompt + a fixed newest token). Each repetition runs speculative steps from that
same state until every row has emitted two tokens (x1, x2); stale cache slots from the previous repetition are never
visible (each step rewrites its own positions first). The expected joint law is p(x1 | ctx) * p(x2 | ctx, x1), from
target-only forwards of the float model, processed by `runtime.sampling.processed_probs` (temperature 0.8, top-k 6,
top-p 0.9, so every sampling transform is exercised). Pearson chi-square over the joint cells (cells with an
expected count < 5 merged), N = 4,000 seeded draws.

Thresholds: the correct rule must give p-value >= 1e-3 (a false alarm 1 time in 1000 for a fixed seed; the seeds are
fixed, so the test is deterministic). Deliberately broken rules must give p-value < 1e-6: resampling a rejection
from p instead of normalize(max(p - q, 0)) (the classic bug), and accepting every draft token. The drafts are
"layers1" (the target's first layer: correlated with the target but different) and "other" (unrelated weights).
"""
import pytest
import torch

import neuron_infer.model.verify as rules
from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import processed_probs
from neuron_infer.model.spec_step import uniforms_width

SAMPLING = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
PROMPT, LAST = [1, 40, 77, 123, 9, 250, 31, 64, 99, 180], 300
B, REPS, K = 500, 8, 3
SMALL = {"max_context_length": 16, "max_length": 32, "context_buckets": (16,), "tokengen_buckets": (32,)}


def broadcast_row0(se) -> None:
    src = torch.tensor(se.target.slots[0])  # slot 0's blocks (the draft shares the block tables)
    dst = torch.tensor(se.target.slots[1:B]).flatten()  # [(B-1) * per] every other slot's blocks, slot-major
    for cache in (se.target.k_cache, se.target.v_cache, se.draft.k_cache, se.draft.v_cache):
        cache[:, dst] = cache[:, src].repeat(1, B - 1, 1, 1, 1)  # [L, N, Hkv, bs, D]: every slot holds slot 0's prompt


def draw_pairs(se, seed: int) -> torch.Tensor:
    """[REPS * B, 2] (x1, x2) emitted by speculative steps from the shared context."""
    gen = torch.Generator().manual_seed(seed)
    full = lambda v: torch.full((B,), v, dtype=torch.int64)
    p = len(PROMPT)
    out = []
    for _ in range(REPS):
        r1 = se.step_all(full(LAST), full(PROMPT[-1]), full(p), SAMPLING, torch.rand(B, uniforms_width(K), generator=gen))
        x1, x2 = r1["tokens"][:, 0], r1["tokens"][:, 1].clone()
        r2 = se.step_all(x1, full(LAST), full(p + 1), SAMPLING, torch.rand(B, uniforms_width(K), generator=gen))
        need = r1["counts"] == 1
        x2[need] = r2["tokens"][need, 0]
        out.append(torch.stack([x1, x2], dim=1))
    return torch.cat(out)


def expected_joint(model) -> dict[tuple[int, int], float]:
    """Target-only law of (x1, x2) from fresh forwards of the float model."""
    def next_probs(seq):
        from neuron_infer.model.kv_cache import CacheShape
        t = len(seq)
        k, v = CacheShape(model.cfg.num_layers, 1, model.cfg.num_kv_heads, t, model.cfg.head_dim,
                          torch.float32).allocate()
        with torch.inference_mode():
            logits = model(torch.tensor([seq]), torch.arange(t).view(1, t), k, v, torch.tensor([[t - 1]]), t,
                           torch.zeros(1, 1, dtype=torch.int64))  # one block of t slots
        return processed_probs(logits[0, 0], SAMPLING)  # [V]

    ctx = PROMPT + [LAST]
    p1, joint = next_probs(ctx), {}
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = next_probs(ctx + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def chi_square_pvalue(pairs: torch.Tensor, joint: dict) -> float:
    n = len(pairs)
    counts: dict = {}
    for a, b in pairs.tolist():
        counts[(a, b)] = counts.get((a, b), 0) + 1
    big = [c for c in joint if joint[c] * n >= 5]
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [joint[c] * n for c in big] + [n * (1 - sum(joint[c] for c in big))]
    if exp[-1] < 1e-9:  # nothing merged: drop the empty cell (its observed count is then 0 too unless broken)
        obs, exp = (obs[:-1], exp[:-1]) if obs[-1] == 0 else (obs, [*exp[:-1], 1e-9])
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def setup(spec_engine):
    def get(draft):
        se = spec_engine(draft=draft, k=K, batch_size=B, **SMALL)
        se.prefill_row(0, PROMPT)
        broadcast_row0(se)
        model = se.target.graphs["context_t16_s16"].model
        return se, expected_joint(model)
    return get


@pytest.mark.parametrize("draft", ["layers1", "other"])
def test_sampled_tokens_follow_the_target_distribution(setup, draft):
    se, joint = setup(draft)
    pairs = draw_pairs(se, seed=1234)
    assert chi_square_pvalue(pairs, joint) >= 1e-3


def test_the_test_has_power_against_resampling_from_p(setup, monkeypatch):
    se, joint = setup("layers1")
    monkeypatch.setattr(rules, "residual_probs", lambda p, q: p)  # broken: rejection resampled from p
    assert chi_square_pvalue(draw_pairs(se, seed=1234), joint) < 1e-6


def test_the_test_has_power_against_accepting_every_draft(setup, monkeypatch):
    se, joint = setup("layers1")
    monkeypatch.setattr(rules, "accepted_prefix", lambda accept: torch.full(accept.shape[:1], accept.shape[1]))
    assert chi_square_pvalue(draw_pairs(se, seed=1234), joint) < 1e-6
