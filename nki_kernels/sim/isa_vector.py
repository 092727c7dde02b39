"""Vector-engine element-wise and reduction instructions (NKI documentation).

Numeric pipeline (A.3): read operands, widen to fp32 (bit-vector ops keep integer bits), compute, cast on write.
All inputs are read before dst is written, so dst may alias an input.
"""
from __future__ import annotations

import numpy as np

from . import alu, runtime
from . import checks as C
from . import dtypes as D
from . import registers as R
from .enums import reduce_cmd as RC
from .errors import SimulationError


def _check_op(o, op: str, gen4_ok: bool = True) -> None:
    if o.name in alu.GEN4_ONLY:
        C.gen_at_least(4, op, f"with nl.{o.name}")


def _bitvec_ints(op: str, *tensors) -> None:
    for t in tensors:
        if t is not None and not D.is_int(t.dtype):
            raise SimulationError(f"{op}: bit-vector operators need integer dtypes, got {D.dtype_name(t.dtype)}")


def _read(t, bitvec: bool):
    return t.read().reshape(t.shape[0], -1) if bitvec else C.read_2d(t)


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """``dst = data1 op data2`` element-wise, no broadcasting (same P and elements per partition)."""
    iname = "tensor_tensor"
    dst, a, b = (C.tensor(x, iname, r) for x, r in ((dst, "dst"), (data1, "data1"), (data2, "data2")))
    o = alu.get(op, f"{iname} op")
    if not o.is_binary:
        raise SimulationError(f"{iname} op must be a binary ALU operator, got nl.{o.name}")
    _check_op(o, iname)
    for role, t in (("dst", dst), ("data1", a), ("data2", b)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    if a.kind == "psum" and b.kind == "psum":
        raise SimulationError(f"{iname} data1 and data2 cannot both be in PSUM; copy one to SBUF first")
    ints = D.is_int(a.dtype) and D.is_int(b.dtype) and D.itemsize(a.dtype) == 4
    default = "gpsimd" if (o.name == "power" or ints) and "psum" not in (a.kind, b.kind, dst.kind) else "vector"
    eng = C.engine_name(engine, default, iname, ("vector", "gpsimd", "scalar"))
    if eng == "gpsimd" and "psum" in (a.kind, b.kind, dst.kind):
        raise SimulationError(f"{iname} on GpSimd cannot access PSUM")
    C.same_partitions(iname, data1=a, data2=b, dst=dst)
    C.same_free(iname, data1=a, data2=b, dst=dst)
    C.writable(dst, iname)
    if o.is_bitvec:
        _bitvec_ints(iname, dst, a, b)
    native_int = eng == "gpsimd" and ints and D.is_int(dst.dtype)
    if C.executing():
        raw = o.is_bitvec or native_int
        C.write(dst, o.binary(_read(a, raw), _read(b, raw), integer=native_int))
    return C.emit(eng, iname, a, dst)


def _scalar_stage(o, x, operand, reverse):
    if o is None:
        return x
    if o.name in alu.ALU_UNARY and o.name not in alu.BINARY:
        return o.unary(x)
    return o.binary(operand, x) if reverse else o.binary(x, operand)


def _op_class(o):
    return None if o is None else ("bitvec" if o.is_bitvec else "arith")


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """``dst = (data op0 operand0) op1 operand1``; operands are numbers or (P, 1) tiles (§5.3)."""
    iname = "tensor_scalar"
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o0 = alu.get(op0, f"{iname} op0")
    o1 = alu.get(op1, f"{iname} op1") if op1 is not None else None
    for o in (o0, o1):
        if o is not None:
            _check_op(o, iname)
    if o1 is not None and _op_class(o0) != _op_class(o1):
        raise SimulationError(f"{iname} op0 (nl.{o0.name}) and op1 (nl.{o1.name}) must both be arithmetic or "
                              f"both bit-vector operators")
    eng = C.engine_name(engine, "vector", iname, ("vector", "scalar", "gpsimd"))
    _engine_rules(eng, o0, o1, iname, (dst, x))
    C.buffers(dst, ("sbuf", "psum"), iname, "dst")
    C.buffers(x, ("sbuf", "psum"), iname, "data")
    parts = C.same_partitions(iname, dst=dst, data=x)
    C.same_free(iname, dst=dst, data=x)
    C.writable(dst, iname)
    bitvec = o0.is_bitvec
    if bitvec:
        _bitvec_ints(iname, dst, x)
    s0 = None if o0.name in alu.ALU_UNARY and operand0 is None else C.scalar_operand(operand0, parts, iname, "operand0", bitvec)
    unary1 = o1 is None or (o1.name in alu.ALU_UNARY and operand1 is None)
    s1 = None if unary1 else C.scalar_operand(operand1, parts, iname, "operand1", bitvec)
    if C.executing():
        t = _scalar_stage(o0, _read(x, bitvec), s0, reverse0)
        C.write(dst, _scalar_stage(o1, t, s1, reverse1))
    return C.emit(eng, iname, x, dst)


def _engine_rules(eng, o0, o1, iname, tensors) -> None:
    ops = {o.name for o in (o0, o1) if o is not None}
    if eng == "gpsimd" and (ops != {"rsqrt"} or any(t.kind == "psum" for t in tensors)):
        raise SimulationError(f"{iname} on GpSimd supports only nl.rsqrt on SBUF operands")
    if eng == "scalar":
        C.gen_at_least(3, iname, "on the scalar engine")
        if runtime.current().gen == 3 and not ops <= {"multiply", "add"}:
            raise SimulationError(f"{iname} on the gen3 scalar engine supports only multiply/add, got {sorted(ops)}")


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``dst = (data op0 operand0) op1 operand1``: operand0 scalar/(P,1), operand1 a full tile; arithmetic only."""
    iname = "scalar_tensor_tensor"
    dst, x, t1 = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data"), C.tensor(operand1, iname, "operand1")
    o0, o1 = alu.get(op0, f"{iname} op0"), alu.get(op1, f"{iname} op1")
    if o0.is_bitvec or o1.is_bitvec:
        raise SimulationError(f"{iname} supports arithmetic operators only")
    for role, t in (("dst", dst), ("data", x), ("operand1", t1)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    if x.kind == "psum" and t1.kind == "psum":
        raise SimulationError(f"{iname} data and operand1 cannot both be in PSUM")
    parts = C.same_partitions(iname, dst=dst, data=x, operand1=t1)
    C.same_free(iname, dst=dst, data=x, operand1=t1)
    C.writable(dst, iname)
    s0 = C.scalar_operand(operand0, parts, iname, "operand0")
    if C.executing():
        t = _scalar_stage(o0, C.read_2d(x), s0, reverse0)
        C.write(dst, _scalar_stage(o1, t, C.read_2d(t1), reverse1))
    return C.emit("vector", iname, x, dst)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce over trailing free axes (never axis 0); ``negate`` multiplies the result by -1 (§5.3)."""
    iname = "tensor_reduce"
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o = alu.get(op, f"{iname} op")
    if o.name not in alu.REDUCERS:
        raise SimulationError(f"{iname} op nl.{o.name} is not reducible; use nl.add, nl.maximum, nl.minimum, ...")
    axes = sorted({a + x.ndim if a < 0 else a for a in ((axis,) if isinstance(axis, int) else tuple(axis))})
    if not axes or axes[0] == 0 or axes != list(range(axes[0], x.ndim)):
        raise SimulationError(f"{iname} axis {axis} must be trailing free axes of the {x.ndim}-D input ending at "
                              f"the last dim (e.g. {x.ndim - 1} or ({', '.join(map(str, range(1, x.ndim)))}))")
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, data=x)
    kept = int(np.prod(x.shape[1:axes[0]]))
    if C.free(dst) != kept:
        raise SimulationError(f"{iname} dst {dst.shape} must hold {kept} element(s) per partition "
                              f"(data {x.shape} reduced over axes {tuple(axes)})")
    C.writable(dst, iname)
    if o.is_bitvec:
        _bitvec_ints(iname, dst, x)
    if C.executing():
        vals = x.read() if o.is_bitvec else C.read_f32(x)
        red = alu.REDUCERS[o.name][0].reduce(vals.reshape(parts, kept, -1), axis=2)
        C.write(dst, -red if negate else red)
    return C.emit("vector", iname, x, dst)


def reciprocal(dst, data, name=None):
    """VectorE ``dst = 1 / data`` (higher precision than the ScalarE table entry)."""
    iname = "reciprocal"
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    C.same_partitions(iname, dst=dst, data=x)
    C.same_free(iname, dst=dst, data=x)
    C.writable(dst, iname)
    if C.executing():
        with np.errstate(divide="ignore"):
            C.write(dst, np.float32(1.0) / C.read_2d(x))
    return C.emit("vector", iname, x, dst)


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=RC.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = data op0 operand0`` plus a per-partition reduction into the VectorE registers (§5.3, A.4)."""
    iname = "tensor_scalar_reduce"
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(data, iname, "data")
    o0 = alu.get(op0, f"{iname} op0")
    red = R.reducer(reduce_op, f"{iname} reduce_op", ("add", "multiply", "maximum", "minimum"))
    cmd = R.check_cmd(reduce_cmd, iname)
    for role, t in (("dst", dst), ("data", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, data=x)
    C.same_free(iname, dst=dst, data=x)
    C.writable(dst, iname)
    s0 = None if o0.name in alu.ALU_UNARY and operand0 is None else C.scalar_operand(operand0, parts, iname, "operand0")
    init = C.scalar_operand(reduce_init, parts, iname, "reduce_init") if reduce_init is not None else None
    ctx = runtime.current()
    if ctx.execute:
        vals = _scalar_stage(o0, C.read_2d(x), s0, reverse0)
        R.update(ctx.vec_acc, parts, cmd, vals, red, init, clobber_on_idle=True)
        C.write(dst, vals)
    R.readout(ctx.vec_acc, parts, reduce_res, iname, negate=reduce_res_negate)
    return C.emit("vector", iname, x, dst)


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=RC.idle, reduce_init=0.0, name=None):
    """gen4 VectorE ``dst = exp(src - max_value)`` with an optional running sum in the VectorE registers."""
    iname = "exponential"
    C.gen_at_least(4, iname)
    dst, x = C.tensor(dst, iname, "dst"), C.tensor(src, iname, "src")
    cmd = R.check_cmd(reduce_cmd, iname)
    for role, t in (("dst", dst), ("src", x)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, src=x)
    C.same_free(iname, dst=dst, src=x)
    C.writable(dst, iname)
    mx = C.scalar_operand(max_value, parts, iname, "max_value")
    init = C.scalar_operand(reduce_init, parts, iname, "reduce_init")
    ctx = runtime.current()
    if ctx.execute:
        vals = alu.OPS["exp"].unary(C.read_2d(x) - mx)
        R.update(ctx.vec_acc, parts, cmd, vals, "add", init, clobber_on_idle=True)
        C.write(dst, vals)
    R.readout(ctx.vec_acc, parts, reduce_res, iname)
    return C.emit("vector", iname, x, dst)
