"""``nki.simulator``: the lower-level simulator entry (``simulate_kernel(func, args, kwargs, lnc=...)``)."""
from ..launch import ShapeSpec, simulate_kernel  # noqa: F401
from ..runtime import recording  # noqa: F401
