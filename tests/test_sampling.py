"""Sampling: the processed distribution (temperature, top-k, top-p) against direct NumPy definitions."""
import numpy as np
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import (
    draw_uniforms,
    host_argmax,
    make_generator,
    processed_probs,
    rows_params,
    sample,
    sample_rows,
)


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


ROW_CONFIGS = [SamplingConfig(), SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_k=5),
               SamplingConfig(temperature=1.3, top_p=0.8), SamplingConfig(temperature=0.9, top_k=10, top_p=0.6)]


def test_rows_with_different_settings_in_one_call_equal_each_row_alone():
    logits = torch.randn(len(ROW_CONFIGS), 64, generator=torch.Generator().manual_seed(5)) * 3  # [B, V]
    got = processed_probs(logits, rows_params(ROW_CONFIGS))  # [B, V]
    for row, cfg in enumerate(ROW_CONFIGS):
        want = processed_probs(logits[row], cfg)  # [V]
        assert torch.equal(got[row] > 0, want > 0)
        assert torch.allclose(got[row], want, atol=1e-6)  # fp32 softmax of another shape
    assert got[0].tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 64).float().tolist()  # greedy row


def test_unfiltered_shortcut_equals_the_sorted_definition():
    """`filters=False` (no top-k/top-p in any row) skips the sort: same distribution as the full path."""
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 4  # [B, V]
    params = rows_params([SamplingConfig(temperature=t) for t in (0.5, 1.0, 1.7)])  # [B, 3]
    assert torch.allclose(processed_probs(logits, params, filters=False), processed_probs(logits, params), atol=1e-6)


def test_sample_rows_draws_each_row_from_its_own_distribution():
    """Mixed rows in one call: greedy rows give the argmax; a row's draw depends only on its logits, its settings
    and its own uniform, so sampling it alone with the same uniform gives the same token."""
    logits = torch.randn(len(ROW_CONFIGS), 64, generator=torch.Generator().manual_seed(7)) * 2  # [B, V]
    gens = [make_generator(s) for s in range(len(ROW_CONFIGS))]
    u = draw_uniforms(ROW_CONFIGS, gens)  # [B]
    got = sample_rows(logits, ROW_CONFIGS, u)
    assert int(got[0]) == int(logits[0].argmax())
    for row, cfg in enumerate(ROW_CONFIGS):
        assert int(sample_rows(logits[row: row + 1], [cfg], u[row: row + 1])[0]) == int(got[row])
    assert draw_uniforms([SamplingConfig()] * 2, gens[:2]) is None  # all greedy: no generator advances


def test_host_argmax_is_torch_argmax():
    """The NumPy path (fp32) and the fallback (bf16) give torch.argmax's ids: the first of tied maxima, a NaN as
    the maximum (its first one), -inf rows, views, 1-3 dims, a tensor that requires grad."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 300)  # [B, K+1, V]
    x[0, 0, 10] = x[0, 0, 20] = 50.0  # tie: the lower id
    x[0, 1, 5] = x[0, 1, 9] = float("nan")  # NaN wins, the first one
    x[0, 1, 2] = float("inf")
    x[0, 2] = float("-inf")  # all -inf: id 0
    x[1, 3, 299] = 60.0  # the last id
    grad = x.clone().requires_grad_()  # .numpy() refuses it: host_argmax detaches
    for t in (x, x[1], x[1, 3], x[:, ::2], x.to(torch.bfloat16), grad):
        got = host_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
