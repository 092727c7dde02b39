"""``nki.compiler``: configuration objects accepted and ignored by the simulator (no compiler runs here)."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileConfig:
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SpecializationConfig:
    options: dict = field(default_factory=dict)


def skip_middle_end_transformations(fn):
    return fn


def enable_stack_allocator(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)
