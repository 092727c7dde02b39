"""Shape conditions that hold for every shape a compiled graph serves."""
from __future__ import annotations

import torch


def known(cond: bool | torch.SymBool) -> bool:
    """`cond`, where its truth is known: a plain bool, or a shape condition export can decide from the static sizes
    and the declared ranges of the dynamic ones. An undecided condition (e.g. `rows <= 8` on a prefill graph's
    dynamic token count) is False and adds no guard, so a shape-dependent fast path is taken only where every shape
    the graph serves takes it; the other path serves any shape. Under torch.jit.trace (the Neuron target's
    torch_neuronx.trace: one static bucket per trace) a size comparison is a traced value: its value at the traced
    shape, as a plain comparison would give."""
    if isinstance(cond, bool) or torch.jit.is_tracing():
        return bool(cond)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)
