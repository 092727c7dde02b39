"""MX linear internals (bit-exact torch dequant vs the golden module) and INT8 specifics (scales, CPU paths)."""
import numpy as np
import pytest
import torch
from torch import nn

from neuron_infer.quant import mx_golden as mg
from neuron_infer.quant.int8 import PACK_MAX_ROWS, Int8Linear, quantize_int8, round_up_bf16
from neuron_infer.quant.mx import MXFP4Linear, MXFP8Linear, e8m0_to_float, pack_fp4_codes, unpack_fp4_bytes


def _lin(k, n, seed=0):
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return lin


def test_e8m0_all_bytes_exact():
    b = torch.arange(255, dtype=torch.uint8)  # 0xFF is NaN, never stored
    expect = np.ldexp(np.float32(1), np.arange(255) - 127).astype(np.float32)
    assert torch.equal(e8m0_to_float(b), torch.from_numpy(expect))


def test_fp4_byte_packing_round_trip():
    codes = np.random.default_rng(0).integers(0, 16, size=(3, 64), dtype=np.uint8)
    packed = pack_fp4_codes(codes)
    assert packed.shape == (3, 32) and (packed[:, 0] & 0x0F == codes[:, 0]).all()  # element 0 in the low nibble
    assert np.array_equal(unpack_fp4_bytes(torch.from_numpy(packed)).numpy(), codes)


@pytest.mark.parametrize("cls", (MXFP8Linear, MXFP4Linear))
def test_mx_module_equals_golden(cls):
    m = cls.from_linear(_lin(80, 12))  # 80 -> padded to 96 (3 blocks)
    assert m.weight_scale.shape == (12, 3)
    el, sc = m.golden_arrays()
    gold = mg.dequantize(el, sc, axis=1)[:, :80]
    assert torch.equal(m.dequantized_weight(), torch.from_numpy(gold))
    ref_el, ref_sc = mg.quantize(mg.pad_axis(_lin(80, 12).weight.detach().numpy(), 32, 1), cls.fmt, cls.rule, 1)
    assert np.array_equal(mg.element_codes(el), mg.element_codes(ref_el)) and np.array_equal(sc, ref_sc)


@pytest.mark.parametrize("cls", (MXFP8Linear, MXFP4Linear))
def test_mx_exact_on_representable_weights(cls):
    rng = np.random.default_rng(3)
    f = mg.get_format(cls.fmt)
    codes = rng.integers(0, 1 << f.bits, size=(4, 64), dtype=np.uint8)
    el = mg.elements_from_codes(codes, cls.fmt).astype(np.float32)
    top = f.max if cls.rule == "ocp" else 2.0 ** f.emax * 0.99  # nki rule keeps one binade of headroom
    el = np.where(np.isfinite(el) & (np.abs(el) <= top), el, 0).astype(f.dtype)
    w = mg.dequantize(el, rng.integers(110, 140, size=(4, 2), dtype=np.uint8))
    lin = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    assert torch.equal(cls.from_linear(lin).dequantized_weight(), torch.from_numpy(w))


def test_int8_scale_rounds_up_and_never_clips():
    s = torch.tensor([1e-3, 0.3, 7.77, 1.0])
    r = round_up_bf16(s)
    assert r.dtype == torch.bfloat16 and (r.float() >= s).all() and (r.float() <= s * (1 + 2 ** -7)).all()
    w = torch.randn(32, 64) * 3
    q, scale = quantize_int8(w)
    assert (w / scale.float()[:, None]).abs().max() <= 127  # no value needed clipping
    assert (q.abs().amax(1) >= 126).all()  # and the range is used (rounding up costs < 1 step)


def test_int8_path_choice_is_static():
    m = Int8Linear.from_linear(_lin(64, 8))
    assert m.use_pack(1) and m.use_pack(PACK_MAX_ROWS) and not m.use_pack(PACK_MAX_ROWS + 1)
    assert not Int8Linear.from_linear(_lin(72, 8)).use_pack(1)  # in % 32 != 0: int8pack_mm is wrong there


def test_int8_packed_path_matches_fallback_path():
    m = Int8Linear.from_linear(_lin(96, 40).to(torch.bfloat16))
    x = torch.randn(1, 96, dtype=torch.bfloat16)
    packed = m(x)  # M = 1 -> torch._weight_int8pack_mm
    fallback = (torch.nn.functional.linear(x.float(), m.weight.float()) * m.weight_scale.float()).bfloat16()
    # both round the output to bf16 once after an fp32-accurate dot product: within 2 bf16 ulps of each other
    assert torch.allclose(packed.float(), fallback.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("cls,fmt", [("MXFP8QuadLinear", "e4m3fn"), ("MXFP4QuadLinear", "e2m1")])
def test_quad_variant_matches_kernel_golden(cls, fmt):
    from neuron_infer.quant import mx

    lin = _lin(200, 24, seed=4)  # in 200 -> padded to 512 (one nc_matmul_mx tile of 128 partitions x 4)
    m = getattr(mx, cls).from_linear(lin)
    assert m.in_padded == 512 and m.weight_scale.shape == (24, 16)
    words, scales = m.kernel_operands()
    assert words.shape == (128, 24) and scales.shape == (16, 24)
    # the kernel operands are exactly what mx_golden.quantize_for_matmul makes from the padded W^T
    wt = mg.pad_axis(lin.weight.detach().numpy().T, 512, axis=0)  # [K_pad, N]
    gw, gs = mg.quantize_for_matmul(wt, fmt, m.rule, partitions=128)
    assert np.array_equal(words, gw) and np.array_equal(scales, gs)
    # and the CPU forward uses the same values: x @ deq^T == nc_matmul_mx golden with an exactly-representable x
    x = np.zeros((512, 2), np.float32)
    x[:200] = np.round(np.random.default_rng(0).standard_normal((200, 2)) * 4) / 4  # fp8-exact values
    xw, xs = mg.quantize_for_matmul(x, "e4m3fn", "nki", partitions=128)
    x_back = mg.from_quad_order(mg.dequantize(mg.unpack_x4(xw, "e4m3fn"), xs, axis=0), axis=0)
    assert np.array_equal(x_back, x)  # quarter steps up to |x| < 4 are MXFP8-exact, so only W is quantized
    gold = mg.matmul_mx_golden(words, xw, scales, xs, fmt, "e4m3fn")  # [N, 2]
    y = (m.dequantized_weight().double() @ torch.from_numpy(x[:200]).double()).float()  # [N, 2]
    assert torch.allclose(y, torch.from_numpy(gold), rtol=1e-6, atol=1e-6)
    b = getattr(mx, cls).empty(200, 24, False, torch.float32)
    b.load_state_dict(m.state_dict(), strict=True)
    assert torch.equal(b.dequantized_weight(), m.dequantized_weight())
