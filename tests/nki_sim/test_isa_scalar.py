"""ScalarE activation table and accumulator registers (NKI documentation)."""
from __future__ import annotations

import math

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in

_erf = np.vectorize(math.erf)   # test-side oracle only (slow Python per element is fine for 4 KiB of data)
_sig = lambda x: 1 / (1 + np.exp(-x))
A7 = {   # reference formulas of the NKI documentation A.7, evaluated in float64
    "copy": lambda x: x, "square": lambda x: x * x, "sigmoid": _sig, "relu": lambda x: np.maximum(x, 0),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    "gelu_apprx_sigmoid": lambda x: x * _sig(1.702 * x),
    "gelu_dx": lambda x: 0.5 * (1 + _erf(x / np.sqrt(2))) + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi),
    "gelu_apprx_sigmoid_dx": lambda x: _sig(1.702 * x) * (1 + 1.702 * x * (1 - _sig(1.702 * x))),
    "silu": lambda x: x * _sig(x), "silu_dx": lambda x: _sig(x) * (1 + x * (1 - _sig(x))), "tanh": np.tanh,
    "softplus": lambda x: np.log1p(np.exp(x)), "mish": lambda x: x * np.tanh(np.log1p(np.exp(x))), "erf": _erf,
    "erf_dx": lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x), "exp": np.exp, "sin": np.sin, "arctan": np.arctan,
    "sign": np.sign, "abs": np.abs,
}
POSITIVE = {"log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "reciprocal": lambda x: 1 / x}


def _act_kernel(op, **kw):
    def kernel(x_hbm):
        x = sbuf_in(x_hbm)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=op, data=x, **kw)
        return hbm_out(y)
    return kernel


@pytest.mark.parametrize("name", sorted(A7) + sorted(POSITIVE))
def test_activation_function_table(rng, name):
    if name in POSITIVE:
        x = rng.uniform(0.05, 8.0, size=(32, 32)).astype(np.float32)
        ref = POSITIVE[name](x.astype(np.float64))
    else:
        x = rng.uniform(-3.0, 3.0, size=(32, 32)).astype(np.float32)   # sin: inside [-pi, pi] (HW valid range)
        ref = A7[name](x.astype(np.float64))
    out = run(_act_kernel(getattr(nl, name)), x)
    # exact formulas evaluated in float64 and rounded to fp32; erf uses a series/A&S approximation (< 2e-7 abs)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=3e-7)


def test_activation_scale_bias_and_prelu(rng):
    x = rng.standard_normal((24, 16)).astype(np.float32)
    scale = rng.standard_normal((24, 1)).astype(np.float32)
    bias = rng.standard_normal((24, 1)).astype(np.float32)

    def kernel(x_hbm, s_hbm, b_hbm):
        t, s, b = sbuf_in(x_hbm), sbuf_in(s_hbm), sbuf_in(b_hbm)
        y = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=t, bias=b, scale=s)
        z = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.activate2(dst=z, op=nl.prelu, data=t, imm0=2.0, imm1=0.5, op0=nl.multiply, op1=nl.add, relu_param=0.1)
        with pytest.raises(SimulationError, match="activate2"):   # the real activation() has no relu_param
            nisa.activation(dst=z, op=nl.prelu, data=t)
        return hbm_out(y), hbm_out(z)

    y, z = run(kernel, x, scale, bias, target="trn3")
    np.testing.assert_allclose(y, np.exp(x.astype(np.float64) * scale + bias), rtol=1e-6)
    v = 2 * x.astype(np.float64) + 0.5
    np.testing.assert_allclose(z, np.where(v >= 0, v, 0.1 * v), rtol=1e-6)


def test_activation_reduce_cmd_chaining(rng):
    a, b = rng.standard_normal((2, 16, 8)).astype(np.float32)

    def kernel(a_hbm, b_hbm):
        x, y = sbuf_in(a_hbm), sbuf_in(b_hbm)
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        r1 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        r2 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        r3 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=d, op=nl.copy, data=x, reduce_op=nl.add, reduce_res=r1,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=d, op=nl.square, data=y, reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.activation(dst=d, op=nl.copy, data=y, reduce_cmd=nisa.reduce_cmd.idle, reduce_res=r2)
        nisa.activation(dst=d, op=nl.copy, data=y, reduce_cmd=nisa.reduce_cmd.reset, reduce_res=r3)
        return hbm_out(r1), hbm_out(r2), hbm_out(r3)

    r1, r2, r3 = run(kernel, a, b)
    np.testing.assert_allclose(r1[:, 0], a.sum(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r2[:, 0], a.sum(axis=1) + (b * b).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(r3, 0)


def test_activation_reduce_with_reduce_res_aliasing_dst_row(rng):
    x = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        nisa.activation_reduce(dst=t, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=t)
        return hbm_out(t)

    np.testing.assert_allclose(run(kernel, x), np.exp(x.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("case,match,target", [
    ("bias_shape", "bias free dimension must be 1", "trn3"),
    ("scalar_bias_gen2", "with a scalar bias .* requires NeuronCore gen3", "trn1"),
    ("reduce_op", "reduce_op must be one of nl.add", "trn3"),
    ("not_activation", "not in the Scalar Engine activation table", "trn3"),
    ("cmd_int", "must be a nisa.reduce_cmd member", "trn3"),
])
def test_activation_validation(case, match, target):
    def kernel():
        x = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        y = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        if case == "bias_shape":
            nisa.activation(dst=y, op=nl.exp, data=x, bias=nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf))
        elif case == "scalar_bias_gen2":
            nisa.activation(dst=y, op=nl.exp, data=x, bias=1.0)
        elif case == "reduce_op":
            nisa.activation(dst=y, op=nl.exp, data=x, reduce_op=nl.maximum, reduce_cmd=nisa.reduce_cmd.reduce)
        elif case == "not_activation":
            nisa.activation(dst=y, op=nl.add, data=x)
        else:
            nisa.activation(dst=y, op=nl.exp, data=x, reduce_cmd=2)

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target)


def test_activate2_two_stage_immediates_and_abs_max_reduce(rng):
    x = rng.standard_normal((16, 12)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        y = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activate2(dst=y, op=nl.tanh, data=t, imm0=1.5, imm1=0.25, op0=nl.multiply, op1=nl.subtract,
                       reverse1=True, reduce_op=nl.abs_max, reduce_res=r, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return hbm_out(y), hbm_out(r)

    y, r = run(kernel, x)
    ref = np.tanh(0.25 - 1.5 * x.astype(np.float64))
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(r[:, 0], ref[np.arange(16), np.abs(ref).argmax(axis=1)], rtol=1e-6)


def test_activate2_rules():
    def kernel(op0, op1):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.activate2(dst=t, op=nl.exp, data=t, imm0=1.0, imm1=0.0, op0=op0, op1=op1)

    with pytest.raises(SimulationError, match="is not one of"):
        run(lambda: kernel(nl.add, nl.add))
    with pytest.raises(SimulationError, match="activate2 requires NeuronCore gen4"):
        run(lambda: kernel(nl.multiply, nl.add), target="trn2")
