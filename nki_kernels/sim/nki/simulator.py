"""``nki.simulator``: the lower-level simulator entry (``simulate_kernel(func, args, kwargs, lnc=...)``), the
multi-rank launcher for ``nki.collectives`` (``simulate_ranks(func, [kwargs per rank], lnc=...)``) and the helpers
that exist only in this simulator (``ShapeSpec`` placeholders, ``Kernel``, ``recording``)."""
from ..launch import Kernel, ShapeSpec, simulate_kernel, simulate_ranks  # noqa: F401
from ..runtime import recording  # noqa: F401
