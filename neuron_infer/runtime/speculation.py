"""Speculation strategies: one step interface over the target Engine, which the Runner calls each step.

    runner = Runner(model)        model: an Engine (plain steps) or a strategy over one
    got = spec.step(runner, scheduled, live)    -> the tokens of a speculative step, or None: take a plain step

Strategies: `SpecEngine` (a draft model, fused or unfused; runtime/spec_engine.py) and `NgramSpec` (prompt lookup;
runtime/ngram_spec.py). A strategy owns its target Engine (`target`); the Engine does not know it is speculated on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from neuron_infer.runtime.engine import Engine, Piece

if TYPE_CHECKING:
    from collections.abc import Sequence as Rows

    from neuron_infer.runtime.sequence import Sequence
    from neuron_infer.runtime.spec_gate import SpecGate


class Speculation(Protocol):
    target: Engine
    k: int  # tokens drafted per step at most
    mode: str  # "fused" | "unfused" | "ngram"
    gate: SpecGate | None  # what decides whether a step that can speculate does (draft models)

    def prefill_row(self, row: int, prompt: list[int], start: int = 0, end: int | None = None,
                    logit_rows: Rows[int] | None = None) -> torch.Tensor:
        """Encode a prompt (piece) into a row of the target (and, with a draft model, the draft)."""

    def prefill_rows(self, pieces: list[Piece]) -> torch.Tensor:
        """Several prompt pieces into their target rows at once (Engine.prefill_rows) -> logits [n, V]."""

    def decode_rows(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A plain step over the named rows -> logits [n, V]."""

    def step(self, run, scheduled: list[Sequence], live: list[Sequence]) -> dict[Sequence, list[int]] | None:
        """A speculative step over the scheduled sequences, when this strategy can serve it (`run`: the Runner:
        its scheduler, agreement, gate, timers and `emit_speculative`); None: the Runner takes a plain step."""


def split(model: Engine | Speculation) -> tuple[Engine, Speculation | None]:
    """(the target Engine, the strategy or None) of what a Runner runs."""
    return (model, None) if isinstance(model, Engine) else (model.target, model)
