"""One exception type for every problem a user can fix.

Each message names the problem (file, field, value) and the fix. The CLI prints the message alone and exits
non-zero; Python callers can catch `NeuronInferError`.
"""


class NeuronInferError(Exception):
    """A user-facing error: `str(err)` names what is wrong and how to fix it."""


class ConfigError(NeuronInferError, ValueError):
    """An invalid or unsupported configuration value."""


class CheckpointError(NeuronInferError):
    """A missing, corrupt or mismatching checkpoint file."""


class ArtifactError(NeuronInferError):
    """A compiled artifact directory that cannot be used (missing, corrupt, other version)."""


class BackendUnavailableError(NeuronInferError):
    """A backend (e.g. the Neuron SDK) that is not installed on this machine."""
