"""Golden MX module: bounds, exactness on representable data, quad layout and x4 pack/unpack round trips."""
import numpy as np
import pytest

from neuron_infer.quant import mx_golden as mg

FMTS = ("e4m3fn", "e2m1", "e5m2")
# mantissa bits per element format: the relative RNE step of a normal element is 2**-(m+1)
MANT = {"e4m3fn": 3, "e2m1": 1, "e5m2": 2}


def _rand(shape, seed=0):
    rng = np.random.default_rng(seed)
    # heavy-tailed values with per-row magnitude spread, like real weights
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, size=shape[:-1] + (1,)))).astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", mg.RULES)
def test_error_within_block_bound(fmt, rule):
    x = _rand((6, 128))
    el, sc = mg.quantize(x, fmt, rule)
    assert el.dtype == mg.get_format(fmt).dtype and sc.shape == (6, 4) and sc.dtype == np.uint8
    y = mg.dequantize(el, sc)
    f = mg.get_format(fmt)
    blocks = x.reshape(6, 4, 32)
    X = np.ldexp(1.0, sc.astype(np.int32) - 127)[..., None]  # [6, 4, 1] block scale
    err = np.abs(y.reshape(6, 4, 32) - blocks)
    # Bound per element (scaled domain v = x/X): RNE error <= half a ulp of v. Normal v: ulp = 2**(floor(log2|v|)-m),
    # so err <= |v| * 2**-(m+1); subnormal/small v: absolute ulp of the smallest binade = 2**(1-bias-m) -> half of it.
    # OCP rule additionally clips v > max: error |v| - max (< |v| - max, bounded by the clip amount itself).
    bias = {"e4m3fn": 7, "e2m1": 1, "e5m2": 15}[fmt]
    v = np.abs(blocks) / X
    half_ulp = np.maximum(v * 2.0 ** -(MANT[fmt] + 1), 2.0 ** (1 - bias - MANT[fmt]) / 2)
    clip = np.maximum(v - f.max, 0)
    assert (err <= (half_ulp + clip) * X * (1 + 1e-6)).all()
    if rule == "nki":
        assert (v < 2 ** f.emax).all() and clip.max() == 0  # the 2x scale leaves headroom: nothing clips


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", mg.RULES)
def test_exact_on_representable_data(fmt, rule):
    rng = np.random.default_rng(1)
    f = mg.get_format(fmt)
    codes = rng.integers(0, 1 << f.bits, size=(4, 64), dtype=np.uint8)
    el = mg.elements_from_codes(codes, fmt).astype(np.float32)
    # "stabilized" data: finite codes, and for the nki rule no element in the top binade (|e| < 2**emax), since
    # that rule keeps one binade of headroom and would halve such blocks (losing the lowest subnormal bit)
    top = f.max if rule == "ocp" else np.nextafter(np.float32(2.0 ** f.emax), 0)
    el = np.where(np.isfinite(el) & (np.abs(el) <= top), el, 0).astype(f.dtype)
    scales = rng.integers(100, 150, size=(4, 2), dtype=np.uint8)
    x = mg.dequantize(el, scales)  # representable by construction
    y = mg.dequantize(*mg.quantize(x, fmt, rule))
    np.testing.assert_array_equal(y, x)


def test_idempotent_ocp_bytes():
    x = mg.dequantize(*mg.quantize(_rand((3, 96), 2), "e4m3fn", "ocp"))
    a = mg.quantize(x, "e4m3fn", "ocp")
    b = mg.quantize(mg.dequantize(*a), "e4m3fn", "ocp")
    np.testing.assert_array_equal(mg.element_codes(a[0]), mg.element_codes(b[0]))
    np.testing.assert_array_equal(a[1], b[1])


def test_scale_rules_differ_by_two():
    x = _rand((2, 64), 3)
    s_ocp = mg.quantize(x, "e4m3fn", "ocp")[1].astype(int)
    s_nki = mg.quantize(x, "e4m3fn", "nki")[1].astype(int)
    np.testing.assert_array_equal(s_nki - s_ocp, 1)


def test_zero_block_and_axis():
    x = np.zeros((64, 3), np.float32)
    x[32:, 1] = 4.0  # representable in e2m1 with scale 2**0
    el, sc = mg.quantize(x, "e2m1", axis=0)
    assert sc.shape == (2, 3) and sc[0, 0] == 0
    np.testing.assert_array_equal(mg.dequantize(el, sc, axis=0), x)


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        mg.quantize(np.ones((2, 40), np.float32), "e4m3fn")
    with pytest.raises(ValueError, match="NaN or inf"):
        mg.quantize(np.full((1, 32), np.inf, np.float32), "e4m3fn")
    with pytest.raises(ValueError, match="unknown"):
        mg.quantize(np.ones((1, 32), np.float32), "int4")
    with pytest.raises(ValueError, match="rule"):
        mg.quantize(np.ones((1, 32), np.float32), "e4m3fn", "fast")


@pytest.mark.parametrize("fmt", FMTS)
def test_pack_unpack_x4_round_trip(fmt):
    rng = np.random.default_rng(4)
    f = mg.get_format(fmt)
    codes = rng.integers(0, 1 << f.bits, size=(256, 5), dtype=np.uint8)
    el = mg.elements_from_codes(codes, fmt)
    w = mg.pack_x4(el, axis=0)
    assert w.shape == (64, 5) and w.dtype == (np.uint16 if f.bits == 4 else np.uint32)
    np.testing.assert_array_equal(mg.element_codes(mg.unpack_x4(w, fmt, axis=0)), codes)
    # explicit word layout: slot q occupies bits [q*bits, (q+1)*bits) (fp8 little-endian bytes, fp4 low nibble first)
    expect = sum(int(codes[q, 0]) << (q * f.bits) for q in range(4))
    assert int(w[0, 0]) == expect


def test_quad_permutation_matches_doc():
    perm = mg.quad_permutation(1024, 128)
    # quad-order position t*512 + 4p + q holds logical k = t*512 + q*128 + p
    for t, p, q in [(0, 0, 1), (0, 5, 3), (1, 127, 2), (1, 9, 0)]:
        assert perm[t * 512 + 4 * p + q] == t * 512 + q * 128 + p
    x = np.arange(1024 * 2, dtype=np.float32).reshape(1024, 2)
    np.testing.assert_array_equal(mg.from_quad_order(mg.to_quad_order(x, 0, 128), 0, 128), x)
    with pytest.raises(ValueError, match="multiple of 4"):
        mg.quad_permutation(576, 128)


def test_hardware_block_is_8_partitions_by_4_slots():
    # P=32: logical k = q*32 + p. A large value at k = 3*32 + 9 (slot 3, partition 9 -> scale row g = 9 // 8 = 1)
    # must raise exactly scale row 1, although k=105 is far from the contiguous range 32..63 of OCP block 1
    w = np.ones((128, 1), np.float32)
    w[3 * 32 + 9, 0] = 1000.0
    packed, sc = mg.quantize_for_matmul(w, "e4m3fn", partitions=32)
    assert packed.shape == (32, 1) and sc.shape == (4, 1)
    base = sc[0, 0]
    np.testing.assert_array_equal(sc[:, 0] == base, [True, False, True, True])  # row g=1 of the only tile


@pytest.mark.parametrize("sf,mf", [("e4m3fn", "e4m3fn"), ("e4m3fn", "e2m1")])
def test_matmul_golden_equals_dequantized_matmul(sf, mf):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((512, 8)).astype(np.float32)  # [K, M]
    b = rng.standard_normal((512, 6)).astype(np.float32)  # [K, N]
    sa, ssa = mg.quantize_for_matmul(a, sf)
    sb, ssb = mg.quantize_for_matmul(b, mf)
    out = mg.matmul_mx_golden(sa, sb, ssa, ssb, sf, mf)
    # reference: dequantize each operand back to logical order, then a plain float64 matmul
    da = mg.from_quad_order(mg.dequantize(mg.unpack_x4(sa, sf), ssa, axis=0), 0)
    db = mg.from_quad_order(mg.dequantize(mg.unpack_x4(sb, mf), ssb, axis=0), 0)
    np.testing.assert_allclose(out, (da.astype(np.float64).T @ db).astype(np.float32), rtol=1e-6, atol=1e-5)
    # and it approximates the unquantized product (loose: fp4 has 1 mantissa bit)
    ref = a.T @ b
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < (0.05 if mf == "e4m3fn" else 0.2)


def test_scatter_scales_sbuf():
    s = np.arange(16 * 2, dtype=np.uint8).reshape(16, 2)
    out = mg.scatter_scales_sbuf(s, 128)
    assert out.shape == (128, 2)
    np.testing.assert_array_equal(out[32 * 1 + 1], s[5])
    np.testing.assert_array_equal(out[96 + 3], s[15])
    assert out.astype(int).sum() == s.astype(int).sum()


def test_no_torch_import():
    import subprocess
    import sys
    code = "import sys, neuron_infer.quant.mx_golden; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=__file__.rsplit("/tests", 1)[0])
    assert r.stdout.strip() == "False", r.stderr
