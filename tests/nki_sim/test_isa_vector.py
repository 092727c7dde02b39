"""Vector-engine instructions against NumPy references (NKI documentation)."""
from __future__ import annotations

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, run_events, sbuf_in

BF16 = ml_dtypes.bfloat16
F = np.float32
ARITH = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "divide": np.divide, "equal": lambda a, b: (a == b).astype(F), "not_equal": lambda a, b: (a != b).astype(F),
    "less": lambda a, b: (a < b).astype(F), "less_equal": lambda a, b: (a <= b).astype(F),
    "greater": lambda a, b: (a > b).astype(F), "greater_equal": lambda a, b: (a >= b).astype(F),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).astype(F), "logical_or": lambda a, b: ((a != 0) | (b != 0)).astype(F),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).astype(F),
}


def _tt_kernel(op, out_dtype=nl.float32, psum_b=False):
    def kernel(a_hbm, b_hbm):
        a = sbuf_in(a_hbm)
        b = sbuf_in(b_hbm, buffer=nl.psum if psum_b else None)
        c = nl.ndarray(a.shape, out_dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=a, data2=b, op=op)
        return hbm_out(c)
    return kernel


@pytest.mark.parametrize("name", sorted(ARITH))
def test_tensor_tensor_arithmetic_ops(rng, name):
    a = rng.integers(-3, 4, size=(70, 33)).astype(F) * 0.5   # small integers make comparisons and ties likely
    b = rng.integers(-3, 4, size=(70, 33)).astype(F) * 0.5
    b = np.where(b == 0, F(0.25), b) if name == "divide" else b
    out = run(_tt_kernel(getattr(nl, name)), a, b)
    np.testing.assert_array_equal(out, ARITH[name](a, b).astype(F))


def test_tensor_tensor_psum_operand_and_bf16_output(rng):
    a = rng.standard_normal((128, 64)).astype(F)
    b = rng.standard_normal((128, 64)).astype(F)
    out = run(_tt_kernel(nl.multiply, nl.bfloat16, psum_b=True), a, b)
    np.testing.assert_array_equal(out.view(np.uint16), (a * b).astype(BF16).view(np.uint16))


@pytest.mark.parametrize("name,ref", [("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
                                      ("bitwise_xor", np.bitwise_xor), ("left_shift", np.left_shift)])
def test_tensor_tensor_bitvec_ops_on_int32(rng, name, ref):
    a = rng.integers(0, 2 ** 20, size=(8, 16)).astype(np.int32)
    b = rng.integers(0, 8, size=(8, 16)).astype(np.int32)
    out, events = run_events(_tt_kernel(getattr(nl, name), nl.int32), a, b)
    np.testing.assert_array_equal(out, ref(a, b))
    assert [e.engine for e in events if e.op == "tensor_tensor"] == ["gpsimd"]   # int32 defaults to GpSimd


def test_tensor_tensor_on_strided_views(rng):
    a = rng.standard_normal((16, 40)).astype(F)

    def kernel(a_hbm):
        t = sbuf_in(a_hbm)
        c = nl.ndarray((16, 20), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=t[:, 0:40:2], data2=t[:, 1:40:2], op=nl.subtract)
        return hbm_out(c)

    np.testing.assert_array_equal(run(kernel, a), a[:, ::2] - a[:, 1::2])


@pytest.mark.parametrize("case,match,target", [
    ("both_psum", "cannot both be in PSUM", "trn3"),
    ("broadcast", "elements per partition differ", "trn3"),
    ("partitions", "data1 partition dimension 256 exceeds maximum 128", "trn3"),
    ("abs_max", "with nl.abs_max requires NeuronCore gen4", "trn2"),
    ("bitvec_float", "bit-vector operators need integer dtypes", "trn3"),
])
def test_tensor_tensor_validation(case, match, target):
    def kernel():
        s = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        d = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        if case == "both_psum":
            p1 = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
            p2 = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
            nisa.tensor_tensor(dst=d, data1=p1, data2=p2, op=nl.add)
        elif case == "broadcast":
            nisa.tensor_tensor(dst=d, data1=s, data2=nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf), op=nl.add)
        elif case == "partitions":
            big = nl.ndarray((256, 8), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=big, data1=big, data2=big, op=nl.add)
        elif case == "abs_max":
            nisa.tensor_tensor(dst=d, data1=s, data2=s, op=nl.abs_max)
        else:
            nisa.tensor_tensor(dst=d, data1=s, data2=s, op=nl.bitwise_and)

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target)


def test_abs_max_abs_min_gen4(rng):
    a = np.array([[-3.0, 2.0, -1.0, 4.0]], F)
    b = np.array([[2.0, -3.0, 1.0, -4.0]], F)
    np.testing.assert_array_equal(run(_tt_kernel(nl.abs_max), a, b), [[-3.0, -3.0, 1.0, -4.0]])  # ties -> y
    np.testing.assert_array_equal(run(_tt_kernel(nl.abs_min), a, b), [[2.0, 2.0, 1.0, -4.0]])


def _ts_kernel(op0, operand0_col, reverse0=False, op1=None, operand1=None, reverse1=False, out=nl.float32):
    def kernel(x_hbm, col_hbm):
        x = sbuf_in(x_hbm)
        o0 = sbuf_in(col_hbm) if operand0_col else 2.5
        y = nl.ndarray(x.shape, out, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=x, op0=op0, operand0=o0, reverse0=reverse0, op1=op1, operand1=operand1,
                           reverse1=reverse1)
        return hbm_out(y)
    return kernel


def test_tensor_scalar_partition_column_and_reverse(rng):
    x = rng.standard_normal((50, 12)).astype(F)
    col = rng.standard_normal((50, 1)).astype(F)
    out = run(_ts_kernel(nl.subtract, True, reverse0=True, op1=nl.multiply, operand1=3.0), x, col)
    np.testing.assert_allclose(out, (col - x) * F(3.0), rtol=0, atol=0)
    out2 = run(_ts_kernel(nl.maximum, False, op1=nl.add, operand1=-1.0, reverse1=True), x, col)
    np.testing.assert_array_equal(out2, F(-1.0) + np.maximum(x, F(2.5)))


def test_tensor_scalar_unary_alu_ops(rng):
    x = rng.uniform(0.5, 4.0, size=(8, 8)).astype(F)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        y = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=t, op0=nl.rsqrt, operand0=None, op1=nl.multiply, operand1=2.0)
        return hbm_out(y)

    np.testing.assert_allclose(run(kernel, x), 2.0 / np.sqrt(x.astype(np.float64)), rtol=1e-6)


def test_tensor_scalar_rules():
    def mixed():
        s = nl.ndarray((4, 8), nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=s, data=s, op0=nl.add, operand0=1, op1=nl.bitwise_and, operand1=3)

    def bad_operand():
        s = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=s, data=s, op0=nl.add, operand0=nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf))

    def scalar_engine_gen3():
        s = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=s, data=s, op0=nl.maximum, operand0=0.0, engine=nisa.engine.scalar)

    with pytest.raises(SimulationError, match="both be arithmetic or both bit-vector"):
        run(mixed)
    with pytest.raises(SimulationError, match=r"must be a scalar or a \(4, 1\) tile"):
        run(bad_operand)
    with pytest.raises(SimulationError, match="gen3 scalar engine supports only multiply/add"):
        run(scalar_engine_gen3, target="trn2")


def test_tensor_scalar_bitvec_shift(rng):
    x = rng.integers(0, 2 ** 16, size=(4, 8)).astype(np.int32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        y = nl.ndarray(t.shape, nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=t, op0=nl.right_shift, operand0=3, op1=nl.bitwise_and, operand1=0xFF)
        return hbm_out(y)

    np.testing.assert_array_equal(run(kernel, x), (x >> 3) & 0xFF)


def test_scalar_tensor_tensor(rng):
    x, y = rng.standard_normal((2, 64, 20)).astype(F)
    col = rng.standard_normal((64, 1)).astype(F)

    def kernel(x_hbm, y_hbm, c_hbm):
        a, b, c = sbuf_in(x_hbm), sbuf_in(y_hbm, buffer=nl.psum), sbuf_in(c_hbm)
        o = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=o, data=a, op0=nl.multiply, operand0=c, op1=nl.subtract, operand1=b,
                                  reverse1=True)
        return hbm_out(o)

    np.testing.assert_array_equal(run(kernel, x, y, col), y - x * col)


@pytest.mark.parametrize("axis,negate", [(2, False), ((1, 2), True), (-1, False)])
def test_tensor_reduce_trailing_axes(rng, axis, negate):
    x = rng.standard_normal((40, 6, 7)).astype(F)
    axes = (axis,) if isinstance(axis, int) else axis
    shape = (40, 6) if axes in ((2,), (-1,)) else (40, 1)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        r = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r, op=nl.maximum, data=t, axis=axis, negate=negate)
        return hbm_out(r)

    ref = x.max(axis=tuple(a % 3 for a in axes)).reshape(shape) * (-1 if negate else 1)
    np.testing.assert_array_equal(run(kernel, x), ref)


def test_tensor_reduce_add_bf16_input(rng):
    x = rng.standard_normal((16, 64)).astype(BF16)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        r = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r, op=nl.add, data=t, axis=1)
        return hbm_out(r)

    # fp32 sums of 64 bf16 values: order-dependent rounding only
    np.testing.assert_allclose(run(kernel, x)[:, 0], x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis,match", [(0, "must be trailing free axes"), (1, "must be trailing free axes"),
                                        (2, r"must hold 6 element\(s\) per partition")])
def test_tensor_reduce_rules(axis, match):
    def kernel():
        t = nl.ndarray((4, 6, 7), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf), op=nl.add, data=t, axis=axis)

    with pytest.raises(SimulationError, match=match):
        run(kernel)


def test_tensor_scalar_reduce_chains_the_vector_accumulator(rng):
    a, b = rng.standard_normal((2, 32, 10)).astype(F)

    def kernel(a_hbm, b_hbm):
        x, y = sbuf_in(a_hbm), sbuf_in(b_hbm)
        d1 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        d2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        first = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
        both = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d1, data=x, op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum,
                                  reduce_res=first, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_scalar_reduce(dst=d2, data=y, op0=nl.abs, operand0=None, reduce_op=nl.maximum,
                                  reduce_res=both, reduce_cmd=nisa.reduce_cmd.reduce, reduce_res_negate=True)
        return hbm_out(d1), hbm_out(d2), hbm_out(first), hbm_out(both)

    d1, d2, first, both = run(kernel, a, b)
    np.testing.assert_array_equal(d1, 2 * a)
    np.testing.assert_array_equal(d2, np.abs(b))
    np.testing.assert_array_equal(first[:, 0], (2 * a).max(axis=1))
    np.testing.assert_array_equal(both[:, 0], -np.maximum((2 * a).max(axis=1), np.abs(b).max(axis=1)))


def test_tensor_scalar_reduce_load_reduce_and_add(rng):
    a = rng.standard_normal((8, 16)).astype(F)

    def kernel(a_hbm):
        x = sbuf_in(a_hbm)
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        res = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d, data=x, op0=nl.add, operand0=1.0, reduce_op=nl.add, reduce_res=res,
                                  reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=10.0)
        return hbm_out(res)

    np.testing.assert_allclose(run(kernel, a)[:, 0], 10 + (a + 1).sum(axis=1), rtol=1e-6)


def test_reciprocal_and_exponential(rng):
    x = rng.uniform(0.1, 3.0, size=(16, 24)).astype(F)
    mx = rng.standard_normal((16, 1)).astype(F)

    def kernel(x_hbm, m_hbm):
        t, m = sbuf_in(x_hbm), sbuf_in(m_hbm)
        r = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=t)
        e = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.exponential(dst=e, src=t, max_value=m, reduce_res=s, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return hbm_out(r), hbm_out(e), hbm_out(s)

    r, e, s = run(kernel, x, mx)
    np.testing.assert_allclose(r, 1 / x.astype(np.float64), rtol=1e-7)
    np.testing.assert_allclose(e, np.exp(x.astype(np.float64) - mx), rtol=1e-6)
    np.testing.assert_allclose(s[:, 0], np.exp(x.astype(np.float64) - mx).sum(axis=1), rtol=1e-5)
    with pytest.raises(SimulationError, match="exponential requires NeuronCore gen4"):
        run(kernel, x, mx, target="trn2")


def test_vector_accumulator_is_poisoned_at_start_and_after_idle_ops(rng):
    x = rng.standard_normal((4, 8)).astype(F)

    def kernel(x_hbm, first_cmd):
        t = sbuf_in(x_hbm)
        d = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        res = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        if first_cmd == "idle_exp":
            nisa.tensor_scalar_reduce(dst=d, data=t, op0=nl.add, operand0=0.0, reduce_op=nl.add,
                                      reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.exponential(dst=d, src=t)              # reduce_cmd=idle may clobber the VectorE registers
        nisa.tensor_scalar_reduce(dst=d, data=t, op0=nl.add, operand0=0.0, reduce_op=nl.add, reduce_res=res,
                                  reduce_cmd=nisa.reduce_cmd.reduce)
        return hbm_out(res)

    assert np.isnan(run(kernel, x, "fresh")).all()
    assert np.isnan(run(kernel, x, "idle_exp")).all()


def test_int32_arithmetic_on_gpsimd_is_exact_integer_math():
    a = np.array([[2 ** 30 + 1, -7, 2 ** 31 - 1]], np.int32)
    b = np.array([[3, 5, 1]], np.int32)
    out = run(_tt_kernel(nl.add, nl.int32), a, b)
    # exact (fp32 would lose the +1 on 2**30 + 1); int32 overflow wraps like native integer math
    np.testing.assert_array_equal(out, np.array([[2 ** 30 + 4, -2, -(2 ** 31)]], np.int32))
