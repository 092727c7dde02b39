"""The pure verification rules on hand-made tensors, and the graph-friendly sampling helpers against their oracles."""
import pytest
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import params_tensor, processed_probs, sample_from_probs
from neuron_infer.model.verify import PAD, greedy_verify, residual_probs, speculative_verify


def one_hot_logits(ids: list[list[int]], v: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float() * 5.0  # [B, K+1, V]


def test_greedy_accepts_the_longest_matching_prefix_then_the_target_token():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])  # [B=4, K=3]
    target = one_hot_logits([[5, 6, 7, 2], [5, 6, 7, 2], [4, 6, 7, 2], [5, 6, 8, 2]])  # argmax per position
    tokens, counts = greedy_verify(draft, target)
    assert counts.tolist() == [4, 2, 1, 3]
    assert tokens.tolist() == [[5, 6, 7, 2], [5, 6, PAD, PAD], [4, PAD, PAD, PAD], [5, 6, 8, PAD]]


def test_inverse_cdf_sampling_follows_the_probabilities_and_skips_zeros():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    n = 4000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n  # an even grid over [0, 1)
    ids = sample_from_probs(probs.expand(n, 6), u)
    freq = torch.bincount(ids, minlength=6).float() / n
    assert torch.allclose(freq, probs, atol=1.0 / n)  # grid quantization only
    edge = sample_from_probs(probs.expand(3, 6), torch.tensor([0.0, 1.0 - 2 ** -24, 0.999999]))
    assert edge.tolist() == [1, 4, 4]  # first and last positive tokens; never a zero-probability id


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6),
                                     (0.5, 1, 1.0), (2.0, 40, 0.95)])
def test_graph_params_over_positions_equal_each_position_alone(t, k, p):
    """The fused graph processes [B, K+1, V] with one params [3]: each position equals processing it alone."""
    logits = torch.randn(3, 5, 300, generator=torch.Generator().manual_seed(0)) * 3  # [B, T, V]
    got = processed_probs(logits, params_tensor(t, k, p))  # [B, T, V]
    ref = torch.stack([torch.stack([processed_probs(logits[b, i], SamplingConfig(temperature=t, top_k=k, top_p=p))
                                    for i in range(5)]) for b in range(3)])  # [B, T, V]
    assert torch.equal(got > 0, ref > 0)  # the same support, exactly
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5)  # fp32 softmax of other shapes may sum in another order


def test_residual_is_the_normalized_positive_part_and_falls_back_to_p_when_empty():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]])
    r = residual_probs(p, q)
    assert torch.allclose(r[0], torch.tensor([1.0, 0.0, 0.0])) and torch.equal(r[1], p[1])


def test_identical_distributions_accept_everything_and_disjoint_ones_nothing():
    gen = torch.Generator().manual_seed(0)
    b, k, v = 2000, 3, 8
    p = torch.softmax(torch.randn(1, k + 1, v, generator=gen), -1).expand(b, k + 1, v)
    q = p[:, :k]
    draft = sample_from_probs(q, torch.rand(b, k, generator=gen))
    _, counts = speculative_verify(draft, q, p, torch.rand(b, k, generator=gen), torch.rand(b, k + 1, generator=gen))
    assert counts.eq(k + 1).all()
    q2 = torch.zeros(b, k, v)
    q2[..., 0] = 1.0  # the draft always proposes token 0 ...
    p2 = p.clone()
    p2[..., 0] = 0.0  # ... which the target never emits
    p2 = p2 / p2.sum(-1, keepdim=True)
    tokens, counts = speculative_verify(torch.zeros(b, k, dtype=torch.int64), q2, p2,
                                        torch.rand(b, k, generator=gen), torch.rand(b, k + 1, generator=gen))
    assert counts.eq(1).all() and tokens[:, 0].ne(0).all() and tokens[:, 1:].eq(PAD).all()


def test_first_emitted_token_of_the_pure_rule_has_law_p():
    """Pure-rule Monte Carlo (N = 200,000): the first emitted token ~ p_0 for a draft q far from p.
    Tolerance 4.5 standard errors per cell (about 1e-5 two-sided per cell, 8 cells)."""
    gen = torch.Generator().manual_seed(1)
    n, k, v = 200_000, 2, 8
    p = torch.softmax(torch.randn(1, k + 1, v, generator=gen), -1).expand(n, k + 1, v)
    q = torch.softmax(2 * torch.randn(1, k, v, generator=gen), -1).expand(n, k, v)
    draft = sample_from_probs(q, torch.rand(n, k, generator=gen))
    tokens, _ = speculative_verify(draft, q, p, torch.rand(n, k, generator=gen), torch.rand(n, k + 1, generator=gen))
    freq = torch.bincount(tokens[:, 0], minlength=v).double() / n
    se = (p[0, 0].double() * (1 - p[0, 0].double()) / n).sqrt()
    assert ((freq - p[0, 0].double()).abs() <= 4.5 * se + 1e-12).all()
