"""``nki.simulator``: the lower-level simulator entry (``simulate_kernel(func, args, kwargs, lnc=...)``) and the
helpers that exist only in this simulator (``ShapeSpec`` placeholders, ``Kernel``, ``recording``)."""
from ..launch import Kernel, ShapeSpec, simulate_kernel  # noqa: F401
from ..runtime import recording  # noqa: F401
