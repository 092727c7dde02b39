"""Bucket routing: static-shape graphs exist for a few sizes; every request uses the smallest that fits."""
from __future__ import annotations

from neuron_infer.errors import NeuronInferError


class PromptTooLongError(NeuronInferError):
    pass


def pick_bucket(length: int, buckets: tuple[int, ...], what: str, flag: str) -> int:
    """Smallest bucket >= length; a clear error when even the largest is too small."""
    for b in buckets:
        if b >= length:
            return b
    raise PromptTooLongError(
        f"{what} of {length} tokens exceeds the largest compiled bucket ({buckets[-1]}); shorten it or recompile "
        f"with a larger {flag}"
    )
