"""Every scheme: dequant(quant(w)) within its bound, fast forward vs its slow twin, state-dict round trip, export."""
import pytest
import torch
from torch import nn

from neuron_infer.quant import get_scheme
from neuron_infer.quant import mx_golden as mg

SCHEMES = ("int8", "fp8", "mxfp8", "mxfp4", "w8a8")
# (in, out): 64/96 take int8's _weight_int8pack_mm path at M <= 8; 72 is not a multiple of 32 (fallback path,
# and the MX padding path); 33 outputs exercise odd N.
SHAPES = ((64, 48), (72, 50), (96, 33))


def _linear(k, n, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        # per-row magnitudes spread over 4 decades, plus one all-zero row (scale edge case)
        w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
        w[n // 2] = 0
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


def _bound_ok(scheme, m, w):
    """Per-element error bound of each scheme (derivations in the scheme modules' docstrings)."""
    deq = m.dequantized_weight()
    err = (deq - w).abs()
    if scheme in ("int8", "w8a8"):
        s = m.weight_scale.float()[:, None]
        return bool((err <= s / 2 * (1 + 1e-6)).all()) and bool((m.weight.abs() <= 127).all())
    if scheme == "fp8":
        s = m.weight_scale[:, None]
        v = w / s  # scaled value, |v| <= 240
        bound = s * torch.clamp(v.abs() * 2.0 ** -4, min=2.0 ** -10)  # half ulp (3 mantissa bits) / subnormal step
        return bool((err <= bound * (1 + 1e-5) + 1e-30).all())
    # MX: exactly what the golden module produces for the same (zero-padded) weight
    wp = mg.pad_axis(w.numpy(), mg.BLOCK, axis=1)
    gold = mg.dequantize(*mg.quantize(wp, m.fmt, m.rule, axis=1), axis=1)[:, : w.shape[1]]
    return bool(torch.equal(deq, torch.from_numpy(gold)))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_within_bound(scheme, shape):
    lin = _linear(*shape, bias=False, dtype=torch.float32)
    m = get_scheme(scheme).from_linear(lin)
    assert m.dequantized_weight().shape == (shape[1], shape[0])
    assert _bound_ok(scheme, m, lin.weight.detach())
    assert torch.isfinite(m.dequantized_weight()).all()


def _tolerance(scheme, dtype):
    # Fast path vs fp32 slow twin, in units of (|x| @ |W|^T + |b|) (the scale of any rounding in a dot product):
    # bf16 compute rounds activations/outputs/scales at 2**-9 relative each; the fast paths round 2-3 times
    # (matmul output, scale product, bias add) -> 2**-7 = 4 such roundings;
    # int8 always computes in bf16 on its packed path (activations cast to bf16) -> 2**-7 even for fp32;
    # fp32 compute: only fp32 summation-order differences -> 1e-5.
    return 2.0 ** -7 if dtype == torch.bfloat16 or scheme == "int8" else 1e-5


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", (1, 5, 20))
def test_forward_matches_slow_twin(scheme, dtype, rows):
    for k, n in SHAPES:
        lin = _linear(k, n, bias=True, dtype=dtype, seed=rows)
        m = get_scheme(scheme).from_linear(lin)
        x = torch.randn(rows, 1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = m(x)
        assert y.shape == (rows, 1, n) and y.dtype == dtype
        assert m.reference_forward(x).dtype == dtype
        ref = m.reference_forward(x.float())  # unrounded fp32 oracle (x.float() is exact for bf16 x)
        # |x| @ |W|^T + |b|: the magnitude every rounding step in the output is relative to
        scale = x.float().abs() @ m.dequantized_weight().abs().T + m.bias.float().abs() + 1e-6  # [rows, 1, n]
        err = ((y.float() - ref).abs() / scale).max().item()
        assert err <= _tolerance(scheme, dtype), (scheme, k, n, err)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_state_dict_round_trip_into_empty(scheme):
    lin = _linear(72, 50, bias=True, dtype=torch.bfloat16)
    a = get_scheme(scheme).from_linear(lin)
    b = get_scheme(scheme).empty(72, 50, True, torch.bfloat16)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(2, 72).bfloat16()
    assert torch.equal(a(x), b(x))
    assert a.weight_bytes() == b.weight_bytes() > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_torch_export(scheme):
    m = get_scheme(scheme).from_linear(_linear(64, 48, bias=True, dtype=torch.bfloat16))
    x = torch.randn(1, 1, 64).bfloat16()
    ep = torch.export.export(m, (x,))
    assert torch.equal(ep.module()(x), m(x))


def test_weight_bytes_compression():
    lin = _linear(1024, 64, bias=False, dtype=torch.bfloat16)
    bf16 = 1024 * 64 * 2
    got = {s: bf16 / get_scheme(s).from_linear(lin).weight_bytes() for s in SCHEMES}
    # int8/w8a8: 1 byte + a per-row scale; fp8 likewise; MXFP8 8.25 bits; MXFP4 4.25 bits per weight
    assert got["int8"] == pytest.approx(2 * 1024 / (1024 + 2))
    assert got["fp8"] == pytest.approx(2 * 1024 / (1024 + 4))
    assert got["mxfp8"] == pytest.approx(16 / 8.25)
    assert got["mxfp4"] == pytest.approx(16 / 4.25)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rejects_non_float_models(scheme):
    from neuron_infer.errors import ConfigError

    with pytest.raises(ConfigError, match="floating-point model dtype"):
        get_scheme(scheme).from_linear(nn.Linear(32, 8).double())
    with pytest.raises(ConfigError, match="meta device"):
        get_scheme(scheme).from_linear(nn.Linear(32, 8, device="meta"))
