"""Exceptions raised by the NKI simulator."""


class SimulationError(AssertionError):
    """A kernel broke an NKI rule (shape, buffer, dtype, generation). Subclasses AssertionError like the real
    simulator's checks (NKI documentation)."""


class CapacityError(SimulationError):
    """Live SBUF or PSUM allocations exceed the target generation's on-chip capacity (§2.2)."""


class SimulatorWarning(UserWarning):
    """Behaviour that is undefined or unreliable on hardware (e.g. accumulate=True into unwritten PSUM)."""
