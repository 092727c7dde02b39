"""Scalar-engine instructions: activation, activation_reduce (NKI documentation)."""
from __future__ import annotations

import numpy as np

from . import alu, runtime
from . import checks as C
from . import dtypes as D
from . import registers as R
from .enums import reduce_cmd as RC
from .errors import SimulationError
from .tensor import NkiTensor


def _activation_fn(op, iname):
    o = alu.get(op, f"{iname} op")
    if o.name not in alu.ACTIVATIONS:
        raise SimulationError(f"{iname} op nl.{o.name} is not in the Scalar Engine activation table "
                              f"({', '.join(sorted(alu.ACTIVATIONS))})")
    return o


def _bias(bias, parts, iname):
    if bias is None:
        return np.float32(0.0)
    if isinstance(bias, NkiTensor):
        if C.free(bias) != 1:
            raise SimulationError(f"{iname} bias free dimension must be 1 (a ({parts}, 1) tile), got {bias.shape}")
        C.buffers(bias, ("sbuf", "psum"), iname, "bias")
        if bias.dtype == D.tfloat32:
            raise SimulationError(f"{iname} bias dtype may be anything except tfloat32")
    else:
        C.gen_at_least(3, iname, "with a scalar bias (pass a (P, 1) tile on gen2)")
    return C.scalar_operand(bias, parts, iname, "bias")


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=RC.idle, name=None):
    """``dst = op(data * scale + bias)`` with optional add-reduction into the ScalarE registers (§5.2).
    ``nl.prelu`` needs a slope, which only ``activate2(relu_param=...)`` takes."""
    if alu.get(op, "activation op").name == "prelu":
        raise SimulationError("activation has no relu_param; use nisa.activate2(op=nl.prelu, relu_param=...)")
    return _activation(dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, 0.0, "activation")


def _activation(dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, relu_param, iname):
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o = _activation_fn(op, iname)
    cmd = R.check_cmd(reduce_cmd, iname)
    if reduce_op is not None:
        R.reducer(reduce_op, f"{iname} reduce_op", ("add",))
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, data=x)
    C.same_free(iname, dst=dst, data=x)
    C.writable(dst, iname)
    b = _bias(bias, parts, iname)
    s = C.scalar_operand(scale, parts, iname, "scale")
    ctx = runtime.current()
    if ctx.execute:
        z = C.read_2d(x) * s + b
        vals = _apply(o, z, relu_param)
        R.update(ctx.act_acc, parts, cmd, vals, "add")
        C.write(dst, vals)
    R.readout(ctx.act_acc, parts, reduce_res, iname)
    return C.emit("scalar", iname, x, dst)


def _apply(o, z, relu_param):
    if o.name == "prelu":
        return np.where(z >= 0, z, np.float32(relu_param) * z).astype(np.float32)
    return o.unary(z)


_ACT2_PAIRS = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
               ("subtract", "bypass"), ("bypass", "bypass")}


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None,
              reduce_res=None, reduce_cmd=RC.idle, name=None):
    """gen4 ScalarE ``dst = op((data op0 imm0) op1 imm1)`` with an optional add/max/min/abs_max/abs_min reduction
    into the ScalarE registers (§5.2)."""
    iname = "activate2"
    C.gen_at_least(4, iname)
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o = _activation_fn(op, iname)
    o0, o1 = alu.get(op0, f"{iname} op0"), alu.get(op1, f"{iname} op1")
    if (o0.name, o1.name) not in _ACT2_PAIRS:
        raise SimulationError(f"{iname} (op0, op1) = (nl.{o0.name}, nl.{o1.name}) is not one of "
                              f"{sorted(_ACT2_PAIRS)}")
    red = None if reduce_op is None else R.reducer(reduce_op, f"{iname} reduce_op",
                                                   ("add", "maximum", "minimum", "abs_max", "abs_min"))
    cmd = R.check_cmd(reduce_cmd, iname)
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, data=x)
    C.same_free(iname, dst=dst, data=x)
    C.writable(dst, iname)
    i0 = C.scalar_operand(imm0, parts, iname, "imm0")
    i1 = C.scalar_operand(imm1, parts, iname, "imm1")
    ctx = runtime.current()
    if ctx.execute:
        t = C.read_2d(x)
        t = o0.binary(i0, t) if reverse0 else o0.binary(t, i0)
        t = o1.binary(i1, t) if reverse1 else o1.binary(t, i1)
        vals = _apply(o, t, relu_param)
        R.update(ctx.act_acc, parts, cmd, vals, red or "add")
        C.write(dst, vals)
    R.readout(ctx.act_acc, parts, reduce_res, iname)
    return C.emit("scalar", iname, x, dst)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd=reset_reduce`` and the register read out into ``reduce_res`` (§5.2)."""
    if reduce_res is None or reduce_op is None:
        raise SimulationError("activation_reduce needs reduce_op=nl.add and reduce_res (a (P, 1) tile)")
    return _activation(dst, op, data, bias, scale, reduce_op, reduce_res, RC.reset_reduce, 0.0, "activation_reduce")
