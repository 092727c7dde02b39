"""Cast-on-write rules (NKI documentation): fp8 range edges, float->int, tf32, NKI_PRECISE_FP."""
from __future__ import annotations

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from .conftest import hbm_out, run, sbuf_in


def _cast_kernel(dtype):
    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        y = nl.ndarray(t.shape, dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=t)
        return hbm_out(y)
    return kernel


def test_fp8_e4m3_max_is_240_and_overflow_follows_ml_dtypes():
    x = np.array([[240.0, 232.0, -240.0, 0.0625, 1e-4, 250.0, 1e6, -1e6]], np.float32)
    out = run(_cast_kernel(nl.float8_e4m3), x)
    assert out.dtype == np.dtype(ml_dtypes.float8_e4m3)
    np.testing.assert_array_equal(out.view(np.uint8), x.astype(ml_dtypes.float8_e4m3).view(np.uint8))
    assert float(out[0, 0]) == 240.0 and float(out[0, 2]) == -240.0
    assert np.isinf(out[0, 6:].astype(np.float32)).all()   # no saturation (hardware behaviour UNCERTAIN, §6.2)


def test_fp8_e4m3fn_max_448_and_e5m2_57344():
    x = np.array([[448.0, 464.0, 500.0, 57344.0]], np.float32)
    fn = run(_cast_kernel(nl.float8_e4m3fn), x).astype(np.float32)
    e5 = run(_cast_kernel(nl.float8_e5m2), x).astype(np.float32)
    assert fn[0, 0] == 448.0 and fn[0, 1] == 448.0 and np.isnan(fn[0, 2])   # RNE to max, beyond -> NaN
    assert e5[0, 3] == 57344.0


def test_float_to_int_rounds_half_even_and_saturates():
    x = np.array([[2.5, 3.5, -2.5, 1e10, -1e10, np.nan, 126.6]], np.float32)
    out = run(_cast_kernel(nl.int8), x)
    np.testing.assert_array_equal(out, np.array([[2, 4, -2, 127, -128, 0, 127]], np.int8))


def test_tf32_keeps_ten_mantissa_bits_round_to_nearest_even():
    x = np.array([[1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -10, 3.0]], np.float32)
    out = run(_cast_kernel(nl.tfloat32), x)
    np.testing.assert_array_equal(out, np.array([[1.0, 1 + 2 ** -9, 1 + 2 ** -10, 3.0]], np.float32))


def test_bf16_round_to_nearest_even_on_write():
    x = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9]], np.float32)
    out = run(_cast_kernel(nl.bfloat16), x).astype(np.float32)
    np.testing.assert_array_equal(out, np.array([[1.0, 1 + 2 ** -6, 1.0]], np.float32))


def _bf16_roundtrip_kernel(a_hbm, b_hbm):
    a, b = sbuf_in(a_hbm), sbuf_in(b_hbm)
    s = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=s, data1=a, data2=b, op=nl.add)       # rounds to bf16 when precise
    d = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=d, data1=s, data2=a, op=nl.subtract)
    return hbm_out(d)


@pytest.mark.parametrize("precise", ["1", "0"])
def test_nki_precise_fp_controls_low_precision_storage(monkeypatch, precise):
    monkeypatch.setenv("NKI_PRECISE_FP", precise)
    a = np.array([[1.0, 2.0]], np.float32)
    b = np.array([[2 ** -10, 2 ** -12]], np.float32)
    out = run(_bf16_roundtrip_kernel, a, b)
    expect = np.zeros_like(a) if precise == "1" else b   # bf16 storage loses the small addend; fp32 keeps it
    np.testing.assert_array_equal(out, expect)
