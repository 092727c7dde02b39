"""The prompts of a `generate` run: `--prompt` values, then `--prompt-file` lines, in order.

An empty or whitespace-only prompt is refused with an error naming it, never replaced by the default prompt or
dropped: generating from nothing is almost always a mistake (an unset shell variable, a stray blank line), and
dropping one prompt would shift every later output against its input. Output i always answers prompt i.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from neuron_infer.errors import NeuronInferError
from neuron_infer.text_input import check_size, read_text_file, split_lines

DEFAULT_PROMPT = "The capital of France is"


def collect_prompts(flags: Sequence[str], prompt_file: str | None) -> list[str]:
    """Every prompt in order (the default prompt when neither --prompt nor --prompt-file is given)."""
    labelled = [(f"--prompt #{i}", p) for i, p in enumerate(flags, 1)]
    if prompt_file is not None:
        lines = split_lines(read_text_file(prompt_file, f"--prompt-file {prompt_file}"))
        if not lines:
            raise NeuronInferError(f"--prompt-file {prompt_file} is empty; write one prompt per line")
        labelled += [(f"--prompt-file {prompt_file} line {n}", p) for n, p in enumerate(lines, 1)]
    if not labelled:
        return [DEFAULT_PROMPT]
    refuse_empty(labelled)
    return [p for _, p in labelled]


def check_sizes(prompts: Sequence[str], max_context_length: int) -> None:
    """Every prompt short enough to be tokenized (text_input.check_size), named by its position."""
    for i, p in enumerate(prompts):
        check_size(f"prompt {i}", p, max_context_length)


def refuse_empty(labelled: Iterable[tuple[str, str]]) -> None:
    """Raise for the first (label, prompt) whose prompt has no text."""
    for label, p in labelled:
        if not p.strip():
            what = "empty" if not p else "only whitespace"
            raise NeuronInferError(f"{label} is {what}; give every prompt some text (or remove that one)")
