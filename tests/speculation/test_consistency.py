"""KV-cache consistency after rejections, and fused == unfused (the same step, one graph vs separate graphs)."""
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.runtime.generate import generate_ids

PROMPT = list(range(30, 48))  # 18 tokens


def test_after_a_rejection_continuing_equals_a_fresh_run_on_the_accepted_prefix(spec_engine):
    se = spec_engine(draft="layers1", k=5)
    first = int(se.prefill_row(0, PROMPT).argmax())
    p = len(PROMPT)
    res = se.step_all(torch.tensor([first]), torch.tensor([PROMPT[-1]]), torch.tensor([p]), SamplingConfig())
    c = int(res["counts"][0])
    assert c < 6  # a rejection happened: slots p+c.. of both caches hold rejected drafts
    accepted = res["tokens"][0, :c].tolist()
    dirty_k = se.target.slot_kv(0)[0][:, :, : p + c]  # [L, Hkv, p+c, D] slots holding prompt, first, accepted[:-1]
    # continue from the dirty cache with plain target decoding (newest token accepted[-1] at position p + c)
    tok, cont = torch.tensor([accepted[-1]]), []
    for i in range(12):
        tok = se.target.decode(tok, torch.tensor([p + c + i])).argmax(-1)
        cont.append(int(tok))
    fresh_prompt = PROMPT + [first] + accepted
    fresh, _ = generate_ids(spec_engine(draft="layers1", k=5, batch_size=2).target, [fresh_prompt], 12,
                            ignore_eos=True)
    assert cont == fresh[0].token_ids
    # the visible cache equals a fresh prefill of the same tokens (fp32, T=K+1 pass vs context pass: 1e-5)
    ref = spec_engine(draft="layers1", k=5, batch_size=2)
    ref.prefill_row(0, fresh_prompt[:-1])
    assert torch.allclose(dirty_k, ref.target.slot_kv(0)[0][:, :, : p + c], atol=1e-5)


def test_speculation_continues_correctly_after_rejections(spec_engine):
    """Many rejected blocks in a row (unrelated draft), then the outputs still equal target-only greedy."""
    se = spec_engine(draft="other", k=6)
    got, m = generate_ids(se, [PROMPT], 50, ignore_eos=True)
    ref, _ = generate_ids(se.target, [PROMPT], 50, ignore_eos=True)
    assert got[0].token_ids == ref[0].token_ids and m.accepted < m.drafted


@pytest.mark.parametrize("draft, k", [("layers1", 3), ("int8", 5), ("other", 2)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=7),
                                      SamplingConfig(temperature=1.2, seed=3)])
def test_fused_equals_unfused(spec_engine, draft, k, sampling):
    se = spec_engine(draft=draft, k=k, batch_size=2)
    prompts = [PROMPT, list(range(100, 111))]
    a, ma = generate_ids(se.with_mode("fused"), prompts, 40, sampling, ignore_eos=True)
    b, mb = generate_ids(se.with_mode("unfused"), prompts, 40, sampling, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert ma.emitted_per_step == mb.emitted_per_step and ma.mode == "fused" and mb.mode == "unfused"


def test_seeded_sampling_is_reproducible_and_seed_dependent(spec_engine):
    se = spec_engine(draft="layers1", k=3)
    s = SamplingConfig(temperature=1.0, seed=11)
    a = generate_ids(se, [PROMPT], 30, s, ignore_eos=True)[0][0].token_ids
    b = generate_ids(se, [PROMPT], 30, s, ignore_eos=True)[0][0].token_ids
    c = generate_ids(se, [PROMPT], 30, SamplingConfig(temperature=1.0, seed=12), ignore_eos=True)[0][0].token_ids
    assert a == b and a != c


def test_metrics_report_acceptance_and_throughput(spec_engine):
    se = spec_engine(draft="full", k=3)
    _, m = generate_ids(se, [PROMPT], 21, ignore_eos=True)
    d = m.to_dict()
    assert d["speculation"]["acceptance_rate"] == 1.0 and d["speculation"]["mean_accepted_tokens_per_step"] == 4.0
    assert m.spec_steps == 5 and m.decode_tokens == 20 and d["tokens_per_s"] > 0
    assert d["tokens_per_s"] == pytest.approx(20 / sum(m.token_latencies_s))


def test_summary_pools_batches(spec_engine):
    from neuron_infer.runtime.metrics import pooled

    se = spec_engine(draft="full", k=3)
    ms = [generate_ids(se, [PROMPT], n, ignore_eos=True)[1] for n in (9, 5)]  # 2 steps of 4, then 1 step of 4
    s = pooled(ms)["speculation"]
    assert s["acceptance_rate"] == 1.0 and s["spec_steps"] == 3 and s["mean_accepted_tokens_per_step"] == 4.0
    assert "speculation" not in pooled([])
