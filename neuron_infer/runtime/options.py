"""RunOptions: how the runtime runs a loaded artifact (prefix caching, chunked prefill, the speculation gate).

Runtime choices, not build choices: the same artifact serves with any of them (its graphs are the same).
"""
from __future__ import annotations

from dataclasses import dataclass

from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError

DEFAULT_CHUNK_TOKENS = 256  # prompt tokens per step while others decode: the default's upper bound


@dataclass(frozen=True)
class RunOptions:
    """prefix_caching: reuse the cached KV blocks of a prompt's start (see docs/kv-cache.md).
    prefill_chunk: prompt tokens encoded per step while other sequences decode (chunked prefill); None: the
    largest context bucket <= 256 (the smallest bucket when all are larger); 0: encode every prompt whole.
    speculation_gate: with a draft model, take plain steps while speculative steps are measured not to pay (off here
    so that the runtime's own callers measure fixed-k speculation; `CompiledModel.load` and the vLLM plugin turn it
    on by default; docs/speculation.md)."""

    prefix_caching: bool = True
    prefill_chunk: int | None = None
    speculation_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("prefix_caching", "speculation_gate"):
            if not isinstance(getattr(self, name), bool):
                raise NeuronInferError(f"{name} must be true or false, got {getattr(self, name)!r}")
        chunk = self.prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise NeuronInferError(f"prefill chunk must be a whole number of tokens >= 0 (0: whole prompts), "
                                   f"got {chunk!r}")

    def chunk_tokens(self, build: BuildConfig) -> int:
        """Prompt tokens per step while others decode, 0 for whole prompts."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        buckets = sorted(build.context_bucket_list)
        return max((t for t in buckets if t <= DEFAULT_CHUNK_TOKENS), default=buckets[0])
