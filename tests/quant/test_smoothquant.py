"""SmoothQuant: calibration hooks, the pure fold, function preservation, and W8A8 quality vs no smoothing."""
import pytest
import torch

from neuron_infer.errors import ConfigError
from neuron_infer.quant.smoothquant import (
    collect_act_absmax,
    fold_into_producer,
    fold_smoothing,
    smooth_model,
    smoothing_factors,
    smoothquant,
)
from tests.quant.fake_llama import FakeLlama, linear_names

CALIB = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
EVAL = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


def test_collect_act_absmax_matches_manual():
    model = FakeLlama()
    stats = collect_act_absmax(model, lambda: model(CALIB))
    assert set(stats) == set(linear_names(model))
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(CALIB))  # the input of layer 0's q/k/v
    assert torch.allclose(stats["model.layers.0.self_attn.q_proj"], x.abs().amax(dim=(0, 1)))
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed
    with pytest.raises(ConfigError, match="saw no activations"):
        collect_act_absmax(model, lambda: None)


def test_fold_is_function_preserving_and_pure():
    g = torch.Generator().manual_seed(2)
    norm_w = torch.rand(32, generator=g) + 0.5
    ws = [torch.randn(16, 32, generator=g), torch.randn(8, 32, generator=g)]
    amax = torch.rand(32, generator=g) * 10
    before = [t.clone() for t in (norm_w, *ws)]
    new_norm, new_ws, s = fold_smoothing(norm_w, ws, amax, alpha=0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, (norm_w, *ws)))  # inputs untouched
    n = torch.randn(5, 32, generator=g)  # normalized activations (before the norm weight)
    for w, nw in zip(ws, new_ws):
        assert torch.allclose((n * norm_w) @ w.T, (n * new_norm) @ nw.T, rtol=1e-5, atol=1e-5)
    # s balances ranges: max|X/s| == max|W*s| per channel when alpha = 0.5
    w_max = torch.stack([w.abs().amax(0) for w in ws]).amax(0)
    assert torch.allclose(amax / s, w_max * s, rtol=1e-5)
    with pytest.raises(ConfigError, match="alpha"):
        smoothing_factors(amax, ws, 1.5)


def test_fold_into_producer_preserves_swiglu():
    g = torch.Generator().manual_seed(3)
    gate, up, down = torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g), torch.randn(8, 24, generator=g)
    x = torch.randn(4, 8, generator=g)
    h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    new_up, _, new_down, _ = fold_into_producer(up, None, down, h.abs().amax(0), alpha=0.5)
    h2 = torch.nn.functional.silu(x @ gate.T) * (x @ new_up.T)
    assert torch.allclose(h @ down.T, h2 @ new_down.T, rtol=1e-4, atol=1e-5)


def test_smooth_model_keeps_logits():
    model = FakeLlama()
    ref = model(EVAL)
    stats = collect_act_absmax(model, lambda: model(CALIB))
    assert smooth_model(model, stats, alpha=0.5) == 3
    assert torch.allclose(model(EVAL), ref, rtol=1e-4, atol=1e-4)


def test_smoothing_flattens_outliers_and_helps_w8a8():
    def w8a8_error(smooth: bool) -> float:
        model = FakeLlama()
        ref = model(EVAL)
        if smooth:
            smoothquant(model, lambda: model(CALIB), alpha=0.5)
        else:
            from neuron_infer.config import QuantConfig
            from neuron_infer.quant import apply_quantization
            apply_quantization(model, QuantConfig(scheme="w8a8"))
        return ((model(EVAL) - ref).pow(2).mean() / ref.pow(2).mean()).item()

    model = FakeLlama()
    raw = collect_act_absmax(model, lambda: model(CALIB))["model.layers.0.self_attn.q_proj"]
    smooth_model(model, collect_act_absmax(model, lambda: model(CALIB)), alpha=0.5)
    smoothed = collect_act_absmax(model, lambda: model(CALIB))["model.layers.0.self_attn.q_proj"]
    # the fake model's input_layernorm has 3 outlier channels (x20): smoothing shrinks the max/median ratio
    assert (smoothed.max() / smoothed.median()) < 0.5 * (raw.max() / raw.median())
    e_plain, e_smooth = w8a8_error(False), w8a8_error(True)
    assert e_smooth < e_plain, (e_smooth, e_plain)


def test_smooth_model_errors():
    model = FakeLlama()
    with pytest.raises(ConfigError, match="no calibration statistics"):
        smooth_model(model, {}, 0.5)
    with pytest.raises(ConfigError, match="Llama"):
        smooth_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), {}, 0.5)
