"""NumPy interpreter of the NKI (Neuron Kernel Interface) API — see nki_kernels/sim/FIDELITY.md.

Kernels never import this package directly: they ``import nki`` (resolved by ``nki_kernels/__init__.py``).
Tools (tests, the cost model) use: ``simulate_kernel``, ``recording``, ``InstrEvent``, ``ShapeSpec``.
"""
from .errors import CapacityError, SimulationError, SimulatorWarning  # noqa: F401
from .events import InstrEvent, ListRecorder, Recorder  # noqa: F401
from .launch import Kernel, ShapeSpec, jit, simulate, simulate_kernel  # noqa: F401
from .runtime import recording  # noqa: F401
