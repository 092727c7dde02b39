"""Sampling: the processed distribution (temperature, top-k, top-p) against direct NumPy definitions."""
import numpy as np
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.runtime.sampling import make_generator, processed_probs, sample


def np_reference(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    z = logits.astype(np.float64) / t
    if k:
        z = np.where(z < np.sort(z)[::-1][k - 1], -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = np.zeros_like(probs, dtype=bool)
        mass = 0.0
        for i in order:  # keep tokens until the mass before them reaches p
            if mass >= p:
                break
            keep[i] = True
            mass += probs[i]
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)])
def test_processed_probs_match_the_definition(t, k, p):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3
    got = processed_probs(logits, SamplingConfig(temperature=t, top_k=k, top_p=p)).numpy()
    np.testing.assert_allclose(got, np_reference(logits.numpy(), t, k, p), atol=1e-6)  # fp32 softmax vs fp64


def test_greedy_is_argmax_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.9]])
    assert sample(logits, SamplingConfig(), make_generator(0)).tolist() == [1, 0]
    assert processed_probs(logits, SamplingConfig())[0].tolist() == [0.0, 1.0, 0.0]


def test_sampling_frequencies_follow_the_distribution():
    """20k draws: every token's frequency within 4.5 sigma of its probability (false alarm ~1e-4 per run)."""
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, -3.0]).repeat(20000, 1)
    cfg = SamplingConfig(temperature=1.0, top_k=4, seed=0)
    draws = sample(logits, cfg, make_generator(0))
    freq = torch.bincount(draws, minlength=5).float() / 20000
    probs = processed_probs(logits[0], cfg)
    sigma = (probs * (1 - probs) / 20000).sqrt()
    assert freq[4] == 0  # outside the top-4
    assert ((freq - probs).abs() <= 4.5 * sigma + 1e-9).all(), (freq, probs)
