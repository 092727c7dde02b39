"""ScalarE / VectorE accumulator registers and ``reduce_cmd`` (NKI documentation)."""
from __future__ import annotations

import numpy as np

from . import alu
from . import checks as C
from .enums import reduce_cmd as RC
from .enums import require
from .errors import SimulationError


def reducer(op, what: str, allowed: tuple[str, ...]):
    o = alu.get(op, what)
    if o.name not in allowed:
        raise SimulationError(f"{what} must be one of {', '.join('nl.' + a for a in allowed)}, got nl.{o.name}")
    return o.name


def update(acc: np.ndarray, parts: int, cmd, values, op_name: str, init=None, clobber_on_idle=False) -> None:
    """Apply ``cmd`` to the first ``parts`` lanes of ``acc`` given this instruction's (P, F) fp32 values.

    ``clobber_on_idle``: VectorE accumulator instructions may overwrite the registers even with ``idle`` (§5.3
    "always use reset_reduce after idle ops"); the simulator poisons them with NaN so a kernel relying on them
    shows NaN instead of silently working.
    """
    fn, ident = alu.REDUCERS[op_name]
    lanes = acc[:parts]
    if cmd == RC.idle:
        if clobber_on_idle:
            lanes[...] = np.nan
        return
    if cmd == RC.reset:
        lanes[...] = ident
        return
    part = fn.reduce(values.astype(np.float32), axis=1) if values is not None else None
    if cmd == RC.reset_reduce:
        lanes[...] = part
    elif cmd == RC.reduce:
        lanes[...] = fn(lanes, part)
    elif cmd == RC.load_reduce:
        start = np.broadcast_to(np.asarray(init if init is not None else ident, dtype=np.float32).reshape(-1),
                                (parts,))
        lanes[...] = fn(start, part)


def readout(acc, parts: int, reduce_res, op: str, negate: bool = False) -> None:
    """Copy the registers into a (P, 1) ``reduce_res`` tile (cast on write)."""
    if reduce_res is None:
        return
    res = C.tensor(reduce_res, op, "reduce_res")
    C.buffers(res, ("sbuf", "psum"), op, "reduce_res")
    if res.shape[0] != parts or C.free(res) != 1:
        raise SimulationError(f"{op} reduce_res must have shape ({parts}, 1), got {res.shape}")
    if C.executing():
        vals = acc[:parts].reshape(parts, 1)
        C.write(res, -vals if negate else vals)


def check_cmd(cmd, op: str):
    return require(cmd, RC, op, "reduce_cmd")
