"""FP8 specifics: Neuron-range bit identity, exact conversion, saturation, OCP rescale, KV-cache cast."""
import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from neuron_infer.errors import CheckpointError
from neuron_infer.quant.fp8 import (
    FP8Linear,
    check_neuron_range,
    fp8_saturating_cast,
    fp8_to_float,
    kv_from_fp8,
    kv_to_fp8,
    quantize_fp8,
    rescale_ocp_fp8,
)

ALL = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_fp8_to_float_exact_on_all_finite_codes():
    ref = ALL.float()
    ok = torch.isfinite(ref)
    assert int(ok.sum()) == 254  # 0x7F and 0xFF are NaN in e4m3fn
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8_to_float(ALL, dt)[ok], ref[ok].to(dt))


def test_neuron_range_codes_are_bit_identical_to_neuron_e4m3():
    codes = np.arange(256, dtype=np.uint8)
    fn = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # OCP e4m3fn
    ieee = codes.view(ml_dtypes.float8_e4m3).astype(np.float32)  # Neuron "FP8_EXP4" (IEEE-like, max 240)
    inside = np.abs(fn) <= 240
    field15 = (codes & 0x78) == 0x78
    np.testing.assert_array_equal(inside, ~field15)  # exactly the 16 exponent-field-15 codes fall outside +-240
    np.testing.assert_array_equal(fn[inside], ieee[inside])  # bit-identical values on the other 240 codes
    assert not np.isfinite(ieee[field15]).any()  # Neuron e4m3 spends field 15 on inf/NaN: >240 is unrepresentable
    assert np.abs(ieee[np.isfinite(ieee)]).max() == 240


def test_quantized_weights_stay_in_range_and_finite_for_extreme_rows():
    w = torch.randn(6, 40)
    w[0] *= 1e-30
    w[1] *= 1e30
    w[2] = 0
    w[3, 5] = 3e38
    q, s = quantize_fp8(w)
    v = fp8_to_float(q)
    assert torch.isfinite(v).all() and v.abs().max() <= 240 and torch.isfinite(s).all()
    deq = v * s[:, None]
    assert torch.isfinite(deq).all() and (deq[2] == 0).all()
    assert (v.abs().amax(1)[[0, 1, 3, 4, 5]] == 240).all()  # every nonzero row uses the full Neuron range


def test_saturating_cast_documented_behaviour():
    x = torch.tensor([0.0, 1.0, -3.25, 240.0, 241.0, 448.0, 1e9, -1e9, float("inf"), float("-inf")])
    y = fp8_saturating_cast(x).float()
    assert torch.equal(y, torch.tensor([0.0, 1.0, -3.25, 240.0, 240.0, 240.0, 240.0, -240.0, 240.0, -240.0]))
    assert torch.isnan(fp8_saturating_cast(torch.tensor([float("nan")])).float()).all()
    r = torch.linspace(-240, 240, 10001)  # in range: never inf/NaN, equals torch's RNE cast
    assert torch.equal(fp8_saturating_cast(r).float(), r.to(torch.float8_e4m3fn).float())


def test_kv_cache_direct_cast_round_trip():
    x = torch.randn(2, 3, 8, 16, dtype=torch.bfloat16) * 4
    x8 = kv_to_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn
    back = kv_from_fp8(x8, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    # 3 mantissa bits: relative RNE error <= 2**-4 for normals (|x| >= 2**-6), absolute <= 2**-10 below
    err = (back.float() - x.float()).abs()
    assert (err <= torch.clamp(x.float().abs() * 2 ** -4, min=2 ** -10)).all()
    assert torch.equal(kv_from_fp8(kv_to_fp8(back), torch.bfloat16), back)  # representable values are exact


def _ocp_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g) * torch.logspace(-2, 0, 16)[:, None]
    scale = w.abs().amax(1) / 448  # OCP: per-channel absmax / 448
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale, w


def test_ocp_checkpoint_rejected_without_rescale():
    q, s, _ = _ocp_checkpoint()
    with pytest.raises(CheckpointError, match=r"outside Neuron's E4M3 range.*rescale"):
        check_neuron_range(q, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="rescale"):
        FP8Linear.from_fp8(q, s, None, torch.bfloat16)


@pytest.mark.parametrize("method", ("pow2", "nxdi"))
def test_rescale_ocp_into_neuron_range(method):
    q, s, _ = _ocp_checkpoint()
    nq, ns = rescale_ocp_fp8(q, s, method=method)
    check_neuron_range(nq, "rescaled")  # no raise
    old = q.float() * s[:, None]
    new = fp8_to_float(nq) * ns[:, None]
    if method == "pow2":  # halving is exact for |v_new| >= 2**-6 (normals); only subnormal last bits can move
        v = fp8_to_float(nq)
        assert torch.equal(new[v.abs() >= 2 ** -6], old[v.abs() >= 2 ** -6])
    m = FP8Linear.from_fp8(nq, ns, None, torch.float32)
    x = torch.randn(3, 64)
    # one extra fp8 rounding (relative 2**-4) on top of the checkpoint's own: compare against the OCP dequant
    ref = x @ old.T
    assert ((m(x) - ref).abs() <= (x.abs() @ old.abs().T) * 2 ** -4 + 1e-6).all()
    assert torch.isfinite(new).all()


def test_rescale_verification_catches_corrupt_input():
    q, s, _ = _ocp_checkpoint()
    bad = q.view(torch.uint8).clone()
    bad[0, 0] = 0x7F  # NaN code
    with pytest.raises(CheckpointError, match="verification failed"):
        rescale_ocp_fp8(bad.view(torch.float8_e4m3fn), s)
    with pytest.raises(CheckpointError, match="per channel"):
        rescale_ocp_fp8(q, torch.ones(3))
    with pytest.raises(CheckpointError, match="unknown"):
        rescale_ocp_fp8(q, s, method="cube")


def test_per_tensor_scale_accepted():
    q, _, _ = _ocp_checkpoint()
    _, ns = rescale_ocp_fp8(q, torch.tensor(0.01))
    assert ns.shape == (16,) and torch.allclose(ns, torch.full((16,), 0.02))


def test_linear_is_exact_on_representable_weights():
    # weights that are fp8 values times a per-row power of two quantize exactly (stabilized data)
    q = fp8_saturating_cast(torch.randn(8, 32) * 60)
    q[:, 0] = 240.0  # row absmax exactly 240 -> scale = 2**e exactly
    w = fp8_to_float(q) * (2.0 ** torch.arange(-4, 4)).float()[:, None]
    m = FP8Linear.from_linear(_with_weight(w))
    assert torch.equal(m.dequantized_weight(), w)


def _with_weight(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def test_checkpoint_rescale_flow():
    from neuron_infer.quant.fp8 import rescale_fp8_state_dict

    q, s, _ = _ocp_checkpoint()
    state = {"model.layers.0.mlp.up_proj.weight": q, "model.layers.0.mlp.up_proj.weight_scale": s[:, None],
             "model.norm.weight": torch.ones(4)}
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*--rescale"):
        rescale_fp8_state_dict(state, rescale=False)
    new = rescale_fp8_state_dict(state, rescale=True)
    assert new["model.norm.weight"] is state["model.norm.weight"] and state["model.layers.0.mlp.up_proj.weight"] is q
    rescale_fp8_state_dict(new, rescale=False)  # now in range: no error
    m = FP8Linear.from_fp8(new["model.layers.0.mlp.up_proj.weight"], new["model.layers.0.mlp.up_proj.weight_scale"],
                           None, torch.float32)
    assert torch.equal(m.dequantized_weight(), fp8_to_float(new["model.layers.0.mlp.up_proj.weight"]) * (s * 2)[:, None])
    with pytest.raises(CheckpointError, match="no '<name>_scale'"):
        rescale_fp8_state_dict({"w": q}, rescale=True)
