"""Greedy speculative decoding equals target-only greedy, token for token (fp32, eager graphs).

The reference is `runtime.generate.generate_ids` on the same target engine (itself checked against Hugging Face in
tests/test_generate.py). Every test also asserts the path it claims to exercise was taken (rejections, full
acceptance, truncation inside a block, tail steps), so none passes vacuously.
"""
import pytest

from neuron_infer.runtime.generate import generate_ids

PROMPT = list(range(5, 25))  # 20 tokens


def reference(se, prompts, n, eos=(), ignore_eos=True):
    res, _ = generate_ids(se.target, prompts, n, eos_ids=eos, ignore_eos=ignore_eos)
    return res


CASES = [(d, k) for d in ("layers1", "full") for k in range(1, 9)]
CASES += [(d, k) for d in ("int8", "other") for k in (2, 5, 8)]


@pytest.mark.parametrize("draft, k", CASES)
def test_greedy_equals_target_for_k_1_to_8(spec_engine, draft, k):
    se = spec_engine(draft=draft, k=k)
    got, m = generate_ids(se, [PROMPT], 60, ignore_eos=True)  # 20 + 60 = 80 <= 96: crosses buckets 32 and 64
    assert got[0].token_ids == reference(se, [PROMPT], 60)[0].token_ids
    assert m.spec_steps > 0 and m.drafted == k * sum(1 for _ in m.emitted_per_step)
    if draft == "full":
        assert m.acceptance_rate == 1.0  # the draft is the target: every proposal accepted, bonus tokens emitted
    if draft == "other":
        assert m.acceptance_rate < 0.5


def test_partial_drafts_see_both_rejections_and_full_blocks(spec_engine):
    counts = []
    for k in (1, 2, 3):
        _, m = generate_ids(spec_engine(draft="int8", k=k), [PROMPT], 60, ignore_eos=True)
        counts += [(c, k) for c in m.emitted_per_step]
    assert any(c == k + 1 for c, k in counts) and any(c < k + 1 for c, k in counts)


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("k, eos_index", [(4, 3), (4, 7), (3, 6), (7, 2)])
def test_eos_inside_an_accepted_block(spec_engine, mode, k, eos_index):
    se = spec_engine(draft="full", k=k)
    ref = reference(se, [PROMPT], 40)[0].token_ids
    eos = ref[eos_index]
    expected = ref[: ref.index(eos) + 1]
    got, m = generate_ids(se.with_mode(mode), [PROMPT], 40, eos_ids=(eos,))
    assert got[0].token_ids == expected and got[0].finish_reason == "eos"
    assert sum(m.emitted_per_step) + 1 > len(expected)  # the EOS block produced tokens after EOS, dropped


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("k, max_new", [(4, 8), (5, 3), (8, 12)])
def test_max_new_tokens_inside_a_block(spec_engine, mode, k, max_new):
    se = spec_engine(draft="full", k=k)
    got, m = generate_ids(se.with_mode(mode), [PROMPT], max_new, ignore_eos=True)
    assert got[0].token_ids == reference(se, [PROMPT], max_new)[0].token_ids
    assert got[0].finish_reason == "max_new_tokens" and sum(m.emitted_per_step) + 1 > max_new


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("k, prompt_len", [(4, 21), (3, 20), (6, 23), (8, 30)])
def test_max_length_inside_a_block_and_the_tail(spec_engine, mode, k, prompt_len):
    se = spec_engine(draft="full", k=k)
    prompt = [(i * 11) % 400 + 5 for i in range(prompt_len)]
    got, m = generate_ids(se.with_mode(mode), [prompt], 500, ignore_eos=True)
    ref = reference(se, [prompt], 500)[0]
    assert got[0].token_ids == ref.token_ids and got[0].finish_reason == "max_length" == ref.finish_reason
    assert len(prompt) + len(got[0].token_ids) == 96
    emitted = 1 + sum(m.emitted_per_step) + m.plain_steps
    assert emitted > len(got[0].token_ids) or m.plain_steps > 0  # truncated inside a block, or ran the tail


def test_max_length_cases_cover_truncation_and_tail(spec_engine):
    """The parametrization above really hits both: a block cut at max_length, and plain tail steps."""
    cut = tail = False
    for k, n in ((4, 21), (6, 23)):
        se = spec_engine(draft="full", k=k)
        prompt = [(i * 11) % 400 + 5 for i in range(n)]
        got, m = generate_ids(se, [prompt], 500, ignore_eos=True)
        cut |= 1 + sum(m.emitted_per_step) + m.plain_steps > len(got[0].token_ids)
        tail |= m.plain_steps > 0
    assert cut and tail


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_batch_rows_accept_different_counts_and_equal_their_single_runs(spec_engine, mode):
    se = spec_engine(draft="layers1", k=3, batch_size=3)
    prompts = [list(range(3, 13)), list(range(50, 80)), list(range(200, 221))]
    got, m = generate_ids(se.with_mode(mode), prompts, 40, ignore_eos=True)
    single = spec_engine(draft="layers1", k=3)
    for p, g in zip(prompts, got):
        assert g.token_ids == reference(single, [p], 40)[0].token_ids
    assert len(set(m.emitted_per_step)) > 1


def test_batch_with_one_row_stopping_early(spec_engine):
    se = spec_engine(draft="full", k=4, batch_size=2)
    prompts = [list(range(3, 13)), list(range(60, 75))]
    ref0 = reference(se, [prompts[0]], 30)[0].token_ids
    eos = ref0[4]
    got, _ = generate_ids(se, prompts, 30, eos_ids=(eos,))
    for p, g in zip(prompts, got):
        want = reference(se, [p], 30, eos=(eos,), ignore_eos=False)[0]
        assert g.token_ids == want.token_ids and g.finish_reason == want.finish_reason
    assert got[0].finish_reason == "eos"


@pytest.mark.parametrize("preset", ["tied", "llama3_rope", "mha"])
def test_other_presets(spec_engine, preset):
    se = spec_engine(preset=preset, draft="layers1", k=3)
    got, _ = generate_ids(se.with_mode("fused"), [PROMPT], 50, ignore_eos=True)
    assert got[0].token_ids == reference(se, [PROMPT], 50)[0].token_ids
