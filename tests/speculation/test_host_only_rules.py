"""Penalties, min-p, logit_bias, min_tokens and logprobs with a draft model: those sequences take plain steps (see runtime/runner.py
`_shared_rule`), and their tokens equal the target model's alone."""
import pytest

from neuron_infer.config import SamplingConfig
from neuron_infer.runtime.generate import generate_ids

PROMPTS = [[5, 9, 9, 14, 3], [7, 7, 7]]


@pytest.mark.parametrize("sampling,logprobs", [
    (SamplingConfig(repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5), None),
    (SamplingConfig(temperature=0.9, min_p=0.1, seed=3), None),
    (SamplingConfig(), 2),
    (SamplingConfig(logit_bias={9: 3.0, 14: -100.0}), None),
    (SamplingConfig(temperature=0.9, seed=3, logit_bias={7: 2.0}), None),
])
def test_host_only_rules_take_plain_steps_and_equal_the_target(spec_engine, sampling, logprobs):
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=2)
    got, m = generate_ids(se, PROMPTS, 8, sampling, (), True, logprobs=logprobs)
    assert m.spec_steps == 0 and m.plain_steps > 0
    ref, _ = generate_ids(se.target, PROMPTS, 8, sampling, (), True, logprobs=logprobs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    if logprobs is not None:
        flat = [[e["logprob"] for e in r.logprobs] for r in got]
        # tolerance: the same fp32 target through the full-batch graph (speculative engine) and alone
        assert flat == [pytest.approx([e["logprob"] for e in r.logprobs], abs=1e-5) for r in ref]
        assert [[e["token_id"] for e in r.logprobs] for r in got] == [r.token_ids for r in got]


def test_plain_sampling_still_speculates(spec_engine):
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=2)
    _, m = generate_ids(se, PROMPTS, 8, SamplingConfig(), (), True)
    assert m.spec_steps > 0


def test_min_tokens_takes_plain_steps_until_reached_then_speculates(spec_engine):
    se = spec_engine(draft="layers1", k=3, mode="fused", batch_size=2)
    ref, _ = generate_ids(se.target, PROMPTS, 10, SamplingConfig(), (), True)
    eos = (ref[0].token_ids[1], ref[1].token_ids[1])  # each would end its sequence at its second token
    c = SamplingConfig(min_tokens=4)
    got, m = generate_ids(se, PROMPTS, 10, c, eos, False)
    want, _ = generate_ids(se.target, PROMPTS, 10, c, eos, False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) >= 4 and not set(r.token_ids[:4]) & set(eos) for r in got)
    assert m.plain_steps >= 3  # the first token comes from the prefill, three more from plain steps
