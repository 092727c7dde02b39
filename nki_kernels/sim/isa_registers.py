"""Virtual registers (``nisa.register_alloc/move/load/store``) and the loops they drive (``nl.dynamic_range``,
``nl.while_loop``), per the NKI 0.6 API reference; NKI 0.7 removed ``nl.dynamic_range`` and ``while reg:``
(``api_version.py``). A register holds a 32-bit integer; the simulator executes the
program in order, so a register's value is known whenever it is used. Register instructions emit no cost events
(they run on the engine sequencers)."""
from __future__ import annotations

import numpy as np

from . import checks as C
from .api_version import removed_in_07
from .errors import SimulationError
from .language_ops import NKIObject


class VirtualRegister(NKIObject):
    """A 32-bit engine register (``nisa.register_alloc``); ``value`` is None until it is written."""

    def __init__(self, value=None):
        super().__init__()
        self.value = None if value is None else _int32(value)

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"

    def __bool__(self) -> bool:
        """``while reg:`` (a runtime loop while the register is nonzero, 0.2-0.6; removed in 0.7)."""
        removed_in_07("while on a VirtualRegister", "nl.while_loop")
        return value_of(self, "while reg") != 0


def _int32(v) -> int:
    return int(np.int64(int(v)).astype(np.int32))


def _register(r, op: str, role: str) -> VirtualRegister:
    if not isinstance(r, VirtualRegister):
        raise SimulationError(f"{op} {role} must be a VirtualRegister (nisa.register_alloc), got {type(r).__name__}")
    return r


def value_of(r, op: str) -> int:
    """The current value of a register (or a plain int)."""
    if isinstance(r, VirtualRegister):
        if r.value is None:
            raise SimulationError(f"{op}: register read before it was written (register_move / register_load)")
        return r.value
    return int(r)


def register_alloc(x=None):
    if x is not None and not isinstance(x, (int, np.integer)):
        raise SimulationError(f"register_alloc(x) takes None or an int, got {type(x).__name__}")
    return VirtualRegister(x)


def register_move(dst, src):
    _register(dst, "register_move", "dst").value = value_of(src, "register_move")


def _one_element(t, op: str, role: str):
    t = C.tensor(t, op, role)
    C.buffers(t, ("hbm", "sbuf"), op, role)
    if t.size != 1 or t.np_dtype.itemsize > 4:
        raise SimulationError(f"{op} {role} must be a tensor with exactly one element of <= 32 bits, got "
                              f"{t.shape} {t.dtype}")
    return t


def register_load(dst, src):
    reg, t = _register(dst, "register_load", "dst"), _one_element(src, "register_load", "src")
    if C.executing():
        reg.value = _int32(np.asarray(C.read_f32(t) if t.np_dtype.kind == "f" else t.read()).reshape(-1)[0])


def register_store(dst, src):
    t, reg = _one_element(dst, "register_store", "dst"), _register(src, "register_store", "src")
    if C.executing():
        C.write(t, np.full(t.shape, value_of(reg, "register_store")))


def dynamic_range(start, stop=None, step=1):
    """On-device loop whose bounds may be registers (0.2-0.6, removed in 0.7); a Python range over their values."""
    removed_in_07("nl.dynamic_range", "nl.fori_loop")
    lo, hi = (0, start) if stop is None else (start, stop)
    return range(value_of(lo, "dynamic_range"), value_of(hi, "dynamic_range"), value_of(step, "dynamic_range"))


def while_loop(init, body_fun):
    """``r = init; while r != 0: r = body_fun(r)`` with ``r`` a register passed by value (0.6+)."""
    r = VirtualRegister(value_of(_register(init, "while_loop", "init"), "while_loop"))
    while r.value != 0:
        nxt = body_fun(VirtualRegister(r.value))
        r = VirtualRegister(value_of(_register(nxt, "while_loop", "body_fun result"), "while_loop"))
