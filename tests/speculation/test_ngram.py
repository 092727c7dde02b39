"""Prompt-lookup (n-gram) speculation: the draft rule, the step policy (tables), greedy identity with plain decoding
and Hugging Face (fp32 tiny models, eager graphs), and losslessness of the point-mass rule (chi-square).

The greedy reference is `generate_ids` on the same target engine (plain steps; itself equal to Hugging Face in
tests/test_generate.py) and Hugging Face directly. Every identity test asserts that speculative steps ran with both
accepted and rejected drafts, so none passes vacuously.
"""
import random
from collections import deque
from types import SimpleNamespace

import pytest
import torch

import neuron_infer.model.verify as rules
import neuron_infer.runtime.ngram as ng
from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import ModelConfig, SamplingConfig, SpeculationConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.sampling import processed_probs
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import eager_ngram_spec
from neuron_infer.runtime.ngram import PRIOR_ACCEPTED, PROBE_EVERY, WINDOW, RowView, SeqState, plan_step, propose
from neuron_infer.runtime.ngram_spec import CALIBRATE_EVERY, CALIBRATE_FIRST, RECHECK_EVERY, NgramSpec, accept
from tests.speculation.conftest import BASE
from tests.speculation.test_sampling_lossless import chi_square_pvalue
from tests.test_generate import hf_greedy

# ---- the draft rule ----------------------------------------------------------------------------------------------
PROPOSE = [
    # tokens, n, k, draft
    ([1, 2, 3, 9, 1, 2, 3], 3, 4, [9, 1, 2, 3]),  # 3-gram match; continuation runs into the suffix
    ([1, 2, 3, 9, 1, 2, 3], 3, 2, [9, 1]),  # k caps the draft
    ([5, 2, 3, 7, 8, 1, 2, 3], 3, 3, [7, 8, 1]),  # no 3-gram [1,2,3] earlier: falls back to the 2-gram [2,3]
    ([4, 3, 6, 3, 8, 3], 3, 2, [8, 3]),  # two 1-gram occurrences of equal weight: the most recent wins (not [6, 3])
    ([4, 3, 6, 5, 3, 6, 7, 3, 8, 3], 3, 2, [6, 7]),  # 3 -> 6 twice, 3 -> 8 once: the more frequent continuation;
    # then 6 -> 5 and 6 -> 7 tie: the most recent
    ([1, 2, 3, 9, 5, 3, 7, 6, 3, 7, 1, 2, 3], 1, 2, [9, 5]),  # n = 1: the occurrence sharing 3 tokens of context
    # (weight 8) outweighs the two sharing 1 (2 + 2)
    ([1, 2, 3, 9, 5, 3, 7, 6, 3, 7, 1, 2, 3], 3, 2, [9, 5]),  # n = 3: the 3-gram occurrence alone votes
    ([1, 2, 3, 4], 3, 4, []),  # no match at any n: no draft
    ([7], 3, 4, []),  # nothing before the suffix
    ([1, 2, 1, 2], 2, 0, []),  # k = 0
    ([1, 2, 9, 1, 2], 1, 4, [9, 1, 2]),  # n = 1 only: the last token alone
]


@pytest.mark.parametrize("tokens, n, k, draft", PROPOSE)
def test_propose(tokens, n, k, draft):
    assert propose(tokens, n, k) == draft
    assert propose(tuple(tokens), n, k) == draft  # any Sequence


def slow_propose(tokens: list[int], ngram_size: int, k: int) -> list[int]:
    """The draft rule written from its definition (ngram.py's docstring), with no shortcuts: every occurrence's
    shared context by slice comparison, every candidate next token weighed over the voters matching the draft."""
    last = len(tokens) - 1
    ends = [e for e in range(last) if tokens[e] == tokens[-1]]
    if k <= 0 or not ends:
        return []
    shared = {e: max(c for c in range(1, min(ng.CONTEXT_CAP, e + 1) + 1) if tokens[e + 1 - c: e + 1] == tokens[last + 1 - c:])
              for e in ends}
    n = min(ngram_size, max(shared.values()))
    voters = [e for e in ends if shared[e] >= n][-ng.VOTERS:]
    draft: list[int] = []
    while len(draft) < k:
        agree = [e for e in voters if e + 1 + len(draft) <= last and tokens[e + 1: e + 1 + len(draft)] == draft]
        if not agree:
            break
        weight = {t: sum(2 ** shared[e] for e in agree if tokens[e + 1 + len(draft)] == t)
                  for t in {tokens[e + 1 + len(draft)] for e in agree}}
        recent = max(e for e in agree if weight[tokens[e + 1 + len(draft)]] == max(weight.values()))
        draft.append(tokens[recent + 1 + len(draft)])
    return draft


@pytest.mark.parametrize("alphabet", [2, 3, 5])
def test_propose_is_its_slow_twin(alphabet):
    """Random sequences over small alphabets with copied stretches (many occurrences, ties, shared contexts past the
    cap), at n = 1..4 and k up to 8: the fast rule's draft is exactly the slow rule's."""
    rng = random.Random(alphabet)
    for _ in range(400):
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 120))]
        for _ in range(rng.randrange(3)):  # copied stretches: shared contexts up to and past CONTEXT_CAP
            i = rng.randrange(len(tokens))
            tokens += tokens[i: i + rng.randrange(1, 40)] + [rng.randrange(alphabet)]
        n, k = rng.randrange(1, 5), rng.randrange(0, 9)
        assert propose(tokens, n, k) == slow_propose(tokens, n, k), (tokens, n, k)


def test_propose_counts_the_most_recent_voters_and_caps_the_context():
    """Only the VOTERS most recent occurrences of the matched suffix vote, and a shared context counts at most
    CONTEXT_CAP tokens."""
    # 3 -> 8 VOTERS times, then 3 -> 9 VOTERS / 2 times: all of them would pick 8; the most recent VOTERS tie (half
    # and half, equal weights) and the most recent wins
    tokens = [1, 3, 8] * ng.VOTERS + [2, 3, 9] * (ng.VOTERS // 2) + [0, 3]
    assert propose(tokens, 3, 1) == slow_propose(tokens, 3, 1) == [9]
    # the longest suffix is found among all earlier occurrences: [7, 3] occurs once, before VOTERS + 6 occurrences
    # of 3 alone
    tokens = [7, 3, 5] + [1, 3, 8] * (ng.VOTERS + 6) + [7, 3]
    assert propose(tokens, 3, 1) == slow_propose(tokens, 3, 1) == [5]
    # one token repeated: more than VOTERS occurrences share the whole context
    tokens = [4] + [5] * (3 * ng.VOTERS)
    assert propose(tokens, 3, 4) == slow_propose(tokens, 3, 4) == [5, 5, 5, 5]
    # the whole 20-token tail earlier (-> 40) shares CONTEXT_CAP tokens of context (weight 2^16); its last 15
    # tokens after another token (-> 41) share 15 (2^15): one such occurrence weighs less, three weigh more
    tail = list(range(10, 10 + ng.CONTEXT_CAP + 4))
    once = tail + [40, 98] + [99] + tail[5:] + [41, 97] + tail
    thrice = tail + [40, 98] + ([99] + tail[5:] + [41, 97]) * 3 + tail
    assert propose(once, 3, 1) == slow_propose(once, 3, 1) == [40]
    assert propose(thrice, 3, 1) == slow_propose(thrice, 3, 1) == [41]


# ---- the policy --------------------------------------------------------------------------------------------------
def test_expected_tokens_are_capped_by_the_draft():
    assert RowView(0, 3.0, 0).expected() == 1.0  # no draft: a plain step's token
    assert RowView(6, 3.0, 0).expected() == 4.0
    assert RowView(2, 3.0, 0).expected() == 3.0  # at most the draft's length is accepted


PLAN = [
    # rows (draft_len, accepted, idle), cost_ratio, expected ks
    ([(5, 4.0, 0)], 1.3, [5]),  # a copying sequence: its whole draft
    ([(2, 4.0, 0)], 1.3, [2]),  # the draft is shorter than K
    ([(5, 0.5, 0)], 1.3, [5]),  # E = 1.5 >= 1.3: pays; the verify pass costs the same for any k, so the whole draft
    ([(0, 4.0, 0)], 1.3, [0]),  # no match: plain
    ([(5, 0.1, 0)], 1.3, [0]),  # E = 1.1 < 1.3: does not pay, plain
    ([(5, 0.1, PROBE_EVERY)], 1.3, [5]),  # ... but a probe is due
    ([(1, 4.0, 0)], 2.5, [0]),  # a one-token draft yields at most 2 tokens: not worth a 2.5-step verify
    ([(6, 1.2, 0)], 2.5, [0]),  # a verify step costing 2.5 plain steps does not pay at 1.2 accepted
    ([(6, 3.1, 0)], 2.5, [6]),  # ... at 3.1 it does (the bursty copying case the per-token rate model missed)
    ([(5, 4.0, 0), (0, 1.0, 0)], 1.3, [5, 0]),  # sum E = 5 + 1 > 2.6: speculate, the other row k = 0
    ([(3, 0.4, 0), (0, 1.0, 0), (0, 1.0, 0)], 1.3, [0, 0, 0]),  # 1.4 + 2 < 3.9: one row cannot carry a batch
]


@pytest.mark.parametrize("rows, ratio, ks", PLAN)
def test_plan_step(rows, ratio, ks):
    assert plan_step([RowView(*r) for r in rows], ratio) == ks


def _estimating(accepted: float) -> SeqState:
    """A state whose window holds one pseudo-draft of `accepted` instead of the prior."""
    return SeqState(recent=deque([accepted], maxlen=WINDOW))


def test_seq_state_window_mean_and_idle():
    st = SeqState()
    assert list(st.recent) == [PRIOR_ACCEPTED] and st.accepted == PRIOR_ACCEPTED  # one pseudo-draft: the prior
    st.update(0, 0)
    st.update(0, 0)
    assert st.idle == 2 and st.accepted == PRIOR_ACCEPTED  # steps without a draft teach nothing
    st.update(6, 6)
    assert st.idle == 0 and st.accepted == pytest.approx((PRIOR_ACCEPTED + 6) / 2)
    for _ in range(WINDOW - 2):
        st.update(6, 0)
    assert st.accepted == pytest.approx((PRIOR_ACCEPTED + 6) / WINDOW)  # misses count, the copied run is remembered
    st.update(6, 0)
    assert st.accepted == pytest.approx(6 / WINDOW)  # the prior left the window first
    st.update(6, 0)
    assert st.accepted == 0.0  # a window of misses: plain steps until a probe or a scored draft that would pay


def test_a_declined_draft_is_scored_by_the_tokens_that_follow():
    st = _estimating(0.0)
    st.watch(10, [7, 8, 9])
    st.watch(11, [1, 2])  # one draft watched at a time
    st.observe([0] * 10 + [7])  # first token matches: undecided, nothing learnt yet
    assert st.shadow == (10, [7, 8, 9]) and list(st.recent) == [0.0]
    st.observe([0] * 10 + [7, 8, 5])  # mismatch at the third: a verify step would have accepted 2
    assert st.shadow is None and list(st.recent) == [0.0, 2] and st.idle == 0
    st.watch(13, [4, 4])
    st.observe([0] * 13 + [4, 4, 4])  # every draft token matched: 2
    assert st.shadow is None and list(st.recent) == [0.0, 2, 2]
    st.watch(16, [3])
    st.observe([0] * 16 + [2])  # rejected at once: 0
    assert list(st.recent) == [0.0, 2, 2, 0]
    st.watch(17, [5, 6])
    st.update(4, 4)  # the sequence drafted and was verified: the watched positions are measured by that step
    assert st.shadow is None and list(st.recent) == [0.0, 2, 2, 0, 4] and st.accepted == pytest.approx(8 / 5)


class _Seq:
    """What NgramSpec.plan reads of a sequence: its tokens (and it must be weak-referenceable)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens


def test_plan_watches_declined_drafts_and_learns_from_plain_steps():
    spec = NgramSpec(SimpleNamespace(build=None, vocab_size=0), graphs={}, k=4, ngram_size=2)  # no graphs run here
    seq = _Seq([1, 2, 3, 4, 1, 2])
    spec.states[seq] = _estimating(0.0)  # E = 1 < 1.3: the draft [3, 4, 1, 2] is declined and watched
    assert spec.plan([seq]) == [[]] and spec.state(seq).shadow == (6, [3, 4, 1, 2])
    seq.tokens += [3, 4, 9]  # the plain steps produced 3, 4, 9: a verify step would have accepted 2
    spec.plan([seq])
    assert list(spec.state(seq).recent) == [0.0, 2]


def test_a_plain_step_now_and_then_keeps_the_cost_ratio_measured():
    spec = NgramSpec(SimpleNamespace(build=None, vocab_size=0), graphs={}, k=4, ngram_size=2)
    seq = _Seq([5, 6, 7, 8] * 4)  # a loop: every step has a whole draft worth verifying
    spec.states[seq] = _estimating(4.0)
    plans = [spec.plan([seq]) for _ in range(CALIBRATE_FIRST + 1)]
    assert all(p[0] for p in plans[:CALIBRATE_FIRST]) and plans[-1] == [[]]  # plain: nothing timed it yet
    spec.clock.add("plain", 0.01, warm_up=False)  # once a plain step is measured, calibration is rarer
    plans = [spec.plan([seq]) for _ in range(CALIBRATE_EVERY + 1)]
    assert all(p[0] for p in plans[:CALIBRATE_EVERY]) and plans[-1] == [[]]


def test_a_verify_step_now_and_then_keeps_a_stale_cost_ratio_from_stopping_speculation():
    """One slow verify step made the ratio 10: every draft is declined (and scored for free, so no probe is due),
    yet after RECHECK_EVERY plain steps the next step with a draft verifies it, and only that one."""
    spec = NgramSpec(SimpleNamespace(build=None, vocab_size=0), graphs={}, k=4, ngram_size=2)
    spec.clock.add("plain", 0.01, warm_up=False)
    spec.clock.add("verify", 0.10, warm_up=False)
    seq = _Seq([5, 6, 7, 8] * 4)
    spec.states[seq] = _estimating(4.0)  # E = 5 < 10
    plans = []
    for _ in range(2 * RECHECK_EVERY + 2):
        plans.append(spec.plan([seq]))
        seq.tokens.append(seq.tokens[-4])  # the plain step's token (the loop goes on; a verify step is not run)
    spoke = [i for i, p in enumerate(plans) if p[0]]
    assert spoke == [RECHECK_EVERY, 2 * RECHECK_EVERY + 1] and len(plans[RECHECK_EVERY][0]) == 4


# ---- configuration -----------------------------------------------------------------------------------------------
def test_config_rules():
    assert SpeculationConfig("ngram", 4).ngram == 3 and SpeculationConfig("ngram", 4, ngram_size=2).ngram == 2
    with pytest.raises(ConfigError, match="fused"):
        SpeculationConfig("ngram", 4, fused=True)
    with pytest.raises(ConfigError, match="ngram"):
        SpeculationConfig("self", 4, draft_layers=1, ngram_size=2)
    with pytest.raises(ConfigError, match="1..16"):
        SpeculationConfig("ngram", 4, ngram_size=0)


# ---- greedy identity ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ngram_spec(tiny_dirs):
    cache = {}

    def get(preset="gqa", k=4, n=3, **build_kw):
        key = (preset, k, n, tuple(sorted(build_kw.items())))
        if key not in cache:
            d = tiny_dirs(preset)
            cfg = ModelConfig.from_model_dir(d)
            build = BASE.replace(speculation=SpeculationConfig("ngram", k, ngram_size=n), **build_kw)
            cache[key] = eager_ngram_spec(build_float_model(cfg, build, load_checkpoint(d, cfg)), build)
        return cache[key]

    return get


PASSAGE = [11, 40, 7, 93, 250, 31, 64, 12, 99, 180, 5, 77]
PROMPT = PASSAGE + [3] + PASSAGE[:4]  # a passage, then its start again: the lookup finds continuations


def used_both_outcomes(m) -> bool:
    return m.spec_steps > 0 and 0 < m.accepted < m.drafted


@pytest.mark.parametrize("k, n", [(1, 3), (3, 3), (5, 2), (8, 1)])
def test_greedy_equals_plain(ngram_spec, k, n):
    spec = ngram_spec(k=k, n=n)
    got, m = generate_ids(spec, [PROMPT], 60, ignore_eos=True)  # crosses buckets 32 and 64
    ref, _ = generate_ids(spec.target, [PROMPT], 60, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids
    assert used_both_outcomes(m)


def test_greedy_batch_of_two_equals_plain(ngram_spec):
    spec = ngram_spec(k=4, batch_size=2)
    prompts = [PROMPT, list(range(30, 45))]
    got, m = generate_ids(spec, prompts, 50, ignore_eos=True)
    ref, _ = generate_ids(spec.target, prompts, 50, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert used_both_outcomes(m)


@pytest.mark.parametrize("preset", ["gqa", "tied"])
def test_greedy_equals_hugging_face(ngram_spec, tiny_dirs, preset):
    spec = ngram_spec(preset=preset, k=4)
    got, m = generate_ids(spec, [PROMPT], 64, ignore_eos=True)
    assert got[0].token_ids == hf_greedy(tiny_dirs(preset), PROMPT, 64)
    assert m.spec_steps > 0


def test_eos_and_max_new_tokens_inside_a_block(ngram_spec):
    spec = ngram_spec(k=6)
    ref, _ = generate_ids(spec.target, [PROMPT], 40, ignore_eos=True)
    ref = ref[0].token_ids
    eos = ref[9]
    got, _ = generate_ids(spec, [PROMPT], 40, eos_ids=(eos,))
    assert got[0].token_ids == ref[: ref.index(eos) + 1] and got[0].finish_reason == "eos"
    got, _ = generate_ids(spec, [PROMPT], 7, ignore_eos=True)
    assert got[0].token_ids == ref[:7]


def test_plain_steps_when_nothing_matches(ngram_spec, monkeypatch):
    import neuron_infer.runtime.ngram_spec as ns

    monkeypatch.setattr(ns, "propose", lambda tokens, n, k: [])
    spec = ngram_spec(k=4)
    got, m = generate_ids(spec, [PROMPT], 20, ignore_eos=True)
    ref, _ = generate_ids(spec.target, [PROMPT], 20, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids
    assert m.spec_steps == 0 and m.plain_steps == 19


# ---- sampling: the point-mass rejection rule is lossless --------------------------------------------------------
SAMPLING = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
N_DRAWS = 4000


def forward_probs(model, seq) -> torch.Tensor:
    """Logits [T, V] at every position of `seq` (a fresh cache)."""
    from neuron_infer.model.kv_cache import CacheShape

    t = len(seq)
    k, v = CacheShape(model.cfg.num_layers, 1, model.cfg.num_kv_heads, t, model.cfg.head_dim,
                      torch.float32).allocate()
    with torch.inference_mode():
        return model(torch.tensor([seq]), torch.arange(t).view(1, t), k, v, torch.arange(t).view(1, t), t,
                     torch.zeros(1, 1, dtype=torch.int64))[0]  # one block of t slots


def lossless_setup(model, ctx):
    """Drafts as a deterministic function of the context (the 2nd most likely token, then the argmax), the verify
    logits for them, and the target-only joint law of (x1, x2)."""
    def draft(c):
        lg = forward_probs(model, c)[-1]
        return [int(lg.topk(2).indices[1])] + [int(lg.argmax())]

    verify = {}

    def logits_after(c):  # logits at the K+1 verify positions for context c (the last token pending)
        key = tuple(c)
        if key not in verify:
            d = draft(c)
            verify[key] = (d, forward_probs(model, c + d)[len(c) - 1:])  # [K+1, V]
        return verify[key]

    p1 = processed_probs(forward_probs(model, ctx)[-1], SAMPLING)
    joint = {}
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = processed_probs(forward_probs(model, ctx + [a])[-1], SAMPLING)
        for b in torch.nonzero(p2).flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    return logits_after, joint


def draw_pairs(logits_after, ctx, seed) -> torch.Tensor:
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(N_DRAWS):
        d, lg = logits_after(ctx)
        toks = accept(lg, d, SAMPLING, gen)
        if len(toks) < 2:
            d2, lg2 = logits_after(ctx + toks)
            toks = toks + accept(lg2, d2, SAMPLING, gen)
        out.append(toks[:2])
    return torch.tensor(out)


@pytest.fixture(scope="module")
def lossless(tiny_dirs):
    d = tiny_dirs("gqa")
    cfg = ModelConfig.from_model_dir(d)
    model = build_float_model(cfg, BASE, load_checkpoint(d, cfg))
    ctx = PROMPT
    return (*lossless_setup(model, ctx), ctx)


def test_sampled_tokens_follow_the_target_distribution(lossless):
    logits_after, joint, ctx = lossless
    d, lg = logits_after(ctx)
    p_d = float(processed_probs(lg[0], SAMPLING)[d[0]])
    assert 0.05 < p_d < 0.95  # the first draft is sometimes accepted, sometimes rejected
    assert chi_square_pvalue(draw_pairs(logits_after, ctx, seed=99), joint) >= 1e-3


def test_the_test_has_power_against_resampling_from_p(lossless, monkeypatch):
    logits_after, joint, ctx = lossless
    monkeypatch.setattr(rules, "residual_probs", lambda p, q: p)  # broken: the rejected draft stays possible
    assert chi_square_pvalue(draw_pairs(logits_after, ctx, seed=99), joint) < 1e-6


def test_the_test_has_power_against_accepting_every_draft(lossless, monkeypatch):
    logits_after, joint, ctx = lossless
    monkeypatch.setattr(rules, "accepted_prefix", lambda a: torch.full(a.shape[:1], a.shape[1]))
    assert chi_square_pvalue(draw_pairs(logits_after, ctx, seed=99), joint) < 1e-6


@pytest.mark.parametrize("sampling,logprobs", [
    (SamplingConfig(repetition_penalty=1.8, presence_penalty=1.0), None),
    (SamplingConfig(temperature=0.9, min_p=0.1, seed=3), None),
    (SamplingConfig(), 2),
])
def test_host_only_rules_take_plain_steps_and_equal_plain(ngram_spec, sampling, logprobs):
    spec = ngram_spec(k=4)
    got, m = generate_ids(spec, [PROMPT], 30, sampling, (), True, logprobs=logprobs)
    ref, _ = generate_ids(spec.target, [PROMPT], 30, sampling, (), True, logprobs=logprobs)
    assert m.spec_steps == 0 and m.plain_steps > 0
    assert got[0].token_ids == ref[0].token_ids


def test_replay_bound_counts_verify_steps_at_their_cost():
    """The benchmark's bound (scripts/bench_ngram.py): an output copied from the prompt takes one verify step; an
    output the lookup never drafts for takes one plain step per token."""
    from scripts.bench_ngram import replay_bound

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # the lookup continues [1, 2, 3] with [4, 5, 6, 7, 8, 1]
    assert replay_bound(prompt, [4, 5, 6, 7, 8], ngram_size=3, k=6, cost=1.5) == pytest.approx(5 / 1.5)
    # a draft of 6 that misses at its 3rd token: 3 tokens from one verify step, then [9, 9] unseen: 2 plain steps
    assert replay_bound(prompt, [4, 5, 0, 9, 9], ngram_size=3, k=6, cost=1.5) == pytest.approx(5 / (1.5 + 1 + 1))
    assert replay_bound([10, 11], [12, 13, 14], ngram_size=3, k=6, cost=1.5) == pytest.approx(1.0)


def test_the_benchmarks_comparison_rule_drafts_the_most_recent_occurrence():
    """scripts/bench_ngram.py replays the simpler rule next to the weighted vote: where the vote follows the more
    frequent continuation, the simpler rule follows the most recent one."""
    from scripts.bench_ngram import propose_recent

    tokens = [4, 3, 6, 5, 3, 6, 7, 3, 8, 3]
    assert propose_recent(tokens, 3, 2) == [8, 3]
    assert propose(tokens, 3, 2) == [6, 7]
    assert propose_recent([5, 2, 3, 7, 8, 1, 2, 3], 3, 3) == [7, 8, 1]  # the longest suffix found first
    assert propose_recent([1, 2, 3, 4], 3, 4) == []


def test_replay_policy_follows_copies_and_stops_verifying_drafts_that_always_miss():
    """The same replay with the policy choosing the verify steps: on a copied output it verifies as every draft
    would; on an output whose every draft misses at its first token, it declines after a few misses (the prior
    leaves the estimate) and stays within 5% of plain decoding, where verifying every draft runs at 1 / cost."""
    from scripts.bench_ngram import replay_bound, replay_policy

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    assert replay_policy(prompt, [4, 5, 6, 7, 8], 3, 6, 1.5) == replay_bound(prompt, [4, 5, 6, 7, 8], 3, 6, 1.5)
    seq, out = [1, 2, 3, 4, 5] * 4, []
    for _ in range(160):  # each token differs from the draft's first: every draft misses at once
        d = propose(seq + out, 3, 6)
        out.append(1 if not d or d[0] != 1 else 2)
    assert replay_bound(seq, out, 3, 6, 1.5) == pytest.approx(1 / 1.5)
    assert 0.95 < replay_policy(seq, out, 3, 6, 1.5) < 1.0
