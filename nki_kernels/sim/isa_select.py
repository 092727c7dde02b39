"""Predicated selection instructions: affine_select (GpSimd), range_select and select_reduce (VectorE)
(NKI documentation)."""
from __future__ import annotations

import numpy as np

from . import alu, runtime
from . import checks as C
from . import dtypes as D
from . import registers as R
from .enums import reduce_cmd as RC
from .errors import SimulationError
from .isa_data import affine_values

_COMPARE = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")


def _cmp_op(op, iname, role):
    o = alu.get(op, f"{iname} {role}")
    if o.name not in _COMPARE:
        raise SimulationError(f"{iname} {role} must be a comparison (nl.equal, nl.greater_equal, ...), got nl.{o.name}")
    return o


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    """``dst = on_true if cmp(offset + p*cm + sum idx*step, 0) else on_false_value`` (GpSimd; SBUF only)."""
    iname = "affine_select"
    dst, src = C.tensor(dst, iname, "dst"), C.tensor(on_true_tile, iname, "on_true_tile")
    cmp = _cmp_op(cmp_op if cmp_op is not None else alu.OPS["equal"], iname, "cmp_op")
    C.buffers(dst, ("sbuf",), iname, "dst")
    C.buffers(src, ("sbuf",), iname, "on_true_tile")
    parts = C.same_partitions(iname, dst=dst, on_true_tile=src)
    free = C.same_free(iname, dst=dst, on_true_tile=src)
    C.writable(dst, iname)
    if not isinstance(on_false_value, (int, float, np.number)):
        raise SimulationError(f"{iname} on_false_value must be a number (fp32 scalar)")
    values = affine_values(pattern, offset, channel_multiplier, parts, free, iname)
    if C.executing():
        keep = cmp.binary(values.astype(np.float32), np.float32(0)) != 0
        C.write(dst, np.where(keep, C.read_2d(src), np.float32(on_false_value)))
    return C.emit("gpsimd", iname, src, dst)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=RC.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=D.FP32_MIN, name=None):
    """Keep ``x[p, f]`` where ``comp_op0(j, bound0[p]) & comp_op1(j, bound1[p])`` with ``j = range_start + f``,
    else FP32_MIN; max-reduce into the VectorE registers (gen3+, §5.3)."""
    iname = "range_select"
    C.gen_at_least(3, iname)
    dst, src = C.tensor(dst, iname, "dst"), C.tensor(on_true_tile, iname, "on_true_tile")
    c0, c1 = _cmp_op(comp_op0, iname, "comp_op0"), _cmp_op(comp_op1, iname, "comp_op1")
    R.reducer(reduce_op if reduce_op is not None else alu.OPS["maximum"], f"{iname} reduce_op", ("maximum",))
    cmd = R.check_cmd(reduce_cmd, iname)
    if float(on_false_value) != D.FP32_MIN:
        raise SimulationError(f"{iname} on_false_value must be FP32_MIN (-3.4028235e38), got {on_false_value}")
    for role, t in (("dst", dst), ("on_true_tile", src)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, on_true_tile=src)
    free = C.same_free(iname, dst=dst, on_true_tile=src)
    C.writable(dst, iname)
    b0 = C.scalar_operand(bound0, parts, iname, "bound0")
    b1 = C.scalar_operand(bound1, parts, iname, "bound1")
    ctx = runtime.current()
    if ctx.execute:
        j = (np.float32(range_start) + np.arange(free, dtype=np.float32))[None, :]
        keep = (c0.binary(j, b0) != 0) & (c1.binary(j, b1) != 0)
        vals = np.where(keep, C.read_2d(src), np.float32(D.FP32_MIN))
        R.update(ctx.vec_acc, parts, cmd, vals, "maximum", clobber_on_idle=True)
        C.write(dst, vals)
    R.readout(ctx.vec_acc, parts, reduce_res, iname)
    return C.emit("vector", iname, src, dst)


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=RC.idle, reduce_op=None,
                  reverse_pred=False, name=None):
    """``dst = where(pred != 0 (xor reverse), on_true, on_false)`` (+ max reduce); on_false scalar or (P, 1)."""
    iname = "select_reduce"
    dst, pred, src = (C.tensor(x, iname, r) for x, r in ((dst, "dst"), (predicate, "predicate"), (on_true, "on_true")))
    R.reducer(reduce_op if reduce_op is not None else alu.OPS["maximum"], f"{iname} reduce_op", ("maximum",))
    cmd = R.check_cmd(reduce_cmd, iname)
    for role, t in (("dst", dst), ("predicate", pred), ("on_true", src)):
        C.buffers(t, ("sbuf", "psum"), iname, role)
    parts = C.same_partitions(iname, dst=dst, predicate=pred, on_true=src)
    C.same_free(iname, dst=dst, predicate=pred, on_true=src)
    C.writable(dst, iname)
    off = C.scalar_operand(on_false, parts, iname, "on_false")
    ctx = runtime.current()
    if ctx.execute:
        mask = (pred.read().reshape(parts, -1) != 0) ^ bool(reverse_pred)
        vals = np.where(mask, C.read_2d(src), off)
        R.update(ctx.vec_acc, parts, cmd, vals, "maximum", clobber_on_idle=True)
        C.write(dst, vals)
    R.readout(ctx.vec_acc, parts, reduce_res, iname)
    return C.emit("vector", iname, src, dst)
