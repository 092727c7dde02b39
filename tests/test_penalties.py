"""Repetition / presence / frequency penalties and min-p in the one sampling definition, against a per-row NumPy
reference and Hugging Face's logits processors; speculation takes plain steps for them."""
import numpy as np
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ConfigError
from neuron_infer.model.sampling import processed_probs, rows_params, sample_rows, token_history
from neuron_infer.runtime.sequence import Sequence, StopRule, shared_rule

V = 12
CONFIGS = [SamplingConfig(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
           SamplingConfig(temperature=1.0, min_p=0.2, repetition_penalty=0.8),
           SamplingConfig(temperature=0.9, top_k=5, min_p=0.05, frequency_penalty=-0.4),
           SamplingConfig(repetition_penalty=2.0)]  # greedy + penalty
PROMPTS, OUTPUTS = [[1, 2, 3], [4, 4], [0], [5, 6]], [[3, 3, 7], [], [8, 8, 8, 2], [6]]


def np_reference(logits, c, prompt, output):
    """One row, plain NumPy: penalties, temperature, min-p, top-k (ties kept), renormalize."""
    x = logits.astype(np.float64).copy()
    for t in set(prompt + output):
        x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t in set(output):
        x[t] -= c.presence_penalty + c.frequency_penalty * output.count(t)
    if c.greedy:
        return np.eye(len(x))[int(np.argmax(x))]
    p = np.exp((x - x.max()) / c.temperature)
    p /= p.sum()
    p[p < c.min_p * p.max()] = 0
    if c.top_k:
        p[p < np.sort(p)[::-1][c.top_k - 1]] = 0
    return p / p.sum()


def test_processed_probs_matches_a_per_row_numpy_reference():
    logits = torch.randn(len(CONFIGS), V, generator=torch.Generator().manual_seed(0)) * 3
    got = processed_probs(logits, rows_params(CONFIGS), True, token_history(PROMPTS, OUTPUTS, V))
    for i, c in enumerate(CONFIGS):
        # tolerance: fp32 softmax against float64 over 12 tokens
        np.testing.assert_allclose(got[i].numpy(), np_reference(logits[i].numpy(), c, PROMPTS[i], OUTPUTS[i]),
                                   atol=1e-6)


def test_repetition_penalty_and_min_p_match_hugging_face():
    tf = pytest.importorskip("transformers")
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 2
    ids = torch.tensor([[1, 2, 3, 3], [0, 5, 9, 9]])
    c = SamplingConfig(temperature=1.0, repetition_penalty=1.4, min_p=0.1)
    hf = tf.RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
    hf = tf.MinPLogitsWarper(0.1)(ids, hf)
    want = torch.softmax(hf, -1)
    history = token_history([r[:2] for r in ids.tolist()], [r[2:] for r in ids.tolist()], V)
    got = processed_probs(logits, rows_params([c, c]), True, history)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)  # same fp32 math, different op order


def test_greedy_rows_take_the_argmax_of_the_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    c = SamplingConfig(repetition_penalty=2.0)
    assert sample_rows(logits, [c], None, token_history([[0]], [[]], 3)).tolist() == [1]  # 5/2 < 4
    assert sample_rows(logits, [SamplingConfig()], None).tolist() == [0]


def test_without_penalties_the_width_3_graph_params_give_the_same_probs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    c = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)
    wide = processed_probs(logits, rows_params([c] * 3))
    narrow = processed_probs(logits, torch.tensor([0.8, 4.0, 0.9]))
    torch.testing.assert_close(wide, narrow, atol=0, rtol=0)


@pytest.mark.parametrize("field,value", [("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
                                         ("frequency_penalty", float("nan")), ("repetition_penalty", float("inf"))])
def test_bad_penalty_values_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**{field: value})


@pytest.mark.parametrize("c", [SamplingConfig(temperature=1.0, repetition_penalty=1.2),
                               SamplingConfig(temperature=1.0, min_p=0.1), SamplingConfig(presence_penalty=0.3)])
def test_penalties_and_min_p_take_plain_steps_under_speculation(c):
    seqs = [Sequence(i, [1], c, StopRule(4), torch.Generator()) for i in range(2)]
    assert shared_rule(seqs) is None
    plain = [Sequence(i, [1], SamplingConfig(temperature=1.0), StopRule(4), torch.Generator()) for i in range(2)]
    assert shared_rule(plain) is not None
