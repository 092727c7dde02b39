"""A Sequence: one request's tokens, sampling settings, stop rule and generator — and the prompt checks.

The stop rule and the prompt checks live here once, for `CompiledModel.generate`, tensor-parallel ranks and the vLLM
worker (which passes vLLM's own stop handling through: its sequences never stop here, vLLM trims the tokens).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError


@dataclass(frozen=True)
class StopRule:
    """When a sequence stops: an EOS id (unless ignore_eos), a stop string in its decoded output, max_new_tokens
    generated, or max_length tokens in all. `max_new_tokens=None` never stops on count (the vLLM worker: vLLM
    decides). `stop_strings` need `decode` (token ids -> text, the artifact's tokenizer)."""

    max_new_tokens: int | None = None
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_length: int | None = None
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise NeuronInferError(f"stop strings must be non-empty text, got {list(self.stop_strings)!r}")
        if self.stop_strings and self.decode is None:
            raise NeuronInferError("stop strings need a tokenizer to decode the output")

    @property
    def tail_tokens(self) -> int:
        """Tokens decoded per check: enough to hold the longest stop string even at one UTF-8 byte per token
        (4 bytes per character at most), plus a few for a token that starts mid-character."""
        return 4 * max(len(s) for s in self.stop_strings) + 4

    def hits_stop_string(self, output: list[int]) -> bool:
        """Whether the output's decoded tail contains a stop string. Checked after every token, so an earlier
        occurrence has already stopped the sequence: only the tail window is decoded (incremental)."""
        if not self.stop_strings:
            return False
        tail = self.decode(output[-self.tail_tokens:])
        return any(s in tail for s in self.stop_strings)


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """The text before the earliest stop string (the whole text when none occurs), as vLLM and OpenAI return it."""
    cuts = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return text[: min(cuts)] if cuts else text


def check_prompt(name: str, prompt: list[int], max_context: int, vocab_size: int | None = None) -> None:
    """One clear error for a prompt the artifact cannot encode (ids past the vocabulary would raise IndexError in
    eager graphs and abort the process in compiled ones)."""
    if not prompt:
        raise NeuronInferError(f"{name} is empty after tokenization; give at least one token")
    if vocab_size is not None:
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise NeuronInferError(f"{name} holds token id {bad[0]}, outside this model's vocabulary "
                                   f"0..{vocab_size - 1}; encode prompts with the artifact's own tokenizer")
    if len(prompt) > max_context:
        raise NeuronInferError(
            f"{name} has {len(prompt)} tokens, more than max_context_length={max_context}; shorten it or recompile "
            "with a larger max_context_length (--max-context-length)"
        )


@dataclass(eq=False)
class Sequence:
    """prompt + output tokens; the last token is not yet in the KV cache. `generator` may be shared by several
    sequences (one seeded generate call) or be the request's own (vLLM, per-request seeds)."""

    seq_id: object
    prompt: list[int]
    sampling: SamplingConfig
    stop: StopRule
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    row: int | None = None  # batch slot while running
    blocks: list[int] = field(default_factory=list)  # KV-cache blocks while running (position p: blocks[p // bs])
    reserved: int = 0  # blocks promised to this sequence and not yet taken
    cached: int = 0  # prompt positions found in the prefix cache at admission (not encoded again)
    finish_reason: str | None = None  # "eos" | "stop" (a stop string) | "max_new_tokens" | "max_length"
    logprobs: int | None = None  # record each output token's logprob and this many top alternatives (None: off)
    # one {"token_id", "logprob", "rank", "top": [[id, logprob], ...]} per output token (see token_logprobs)
    output_logprobs: list[dict] | None = None
    # the token ids sampling.min_tokens holds back (None: the stop rule's EOS ids, unless it ignores EOS; the vLLM
    # worker passes the request's stop token ids and EOS, as vLLM's own min_tokens does)
    stop_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None  # score the prompt: each prompt token's logprob and this many top alternatives
    # one record (as output_logprobs) per prompt position 1..len(prompt)-1, filled as the prompt is encoded
    prompt_records: list[dict] | None = None
    allowed: torch.Tensor | None = None  # bool [V]: the only tokens its next sampled token may be (a grammar's mask,
    # set by the caller before a step, cleared when the token is sampled); None: unconstrained
    grammar: object | None = None  # a runtime.grammar.TokenGrammar: its mask is taken before each sampled token

    def __post_init__(self) -> None:
        if self.logprobs is not None:
            if self.logprobs < 0:
                raise NeuronInferError(f"logprobs={self.logprobs} must be >= 0 (the number of top alternatives)")
            self.output_logprobs = []
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < 0:
                raise NeuronInferError(f"prompt_logprobs={self.prompt_logprobs} must be >= 0 (the number of top "
                                       "alternatives)")
            self.prompt_records = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def held_ids(self) -> tuple[int, ...]:
        """The stop token ids that cannot be sampled while the output is shorter than sampling.min_tokens."""
        if self.stop_ids is not None:
            return self.stop_ids
        return () if self.stop.ignore_eos else self.stop.eos_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> list[int]:
        """Append tokens in order until the stop rule fires; returns the tokens kept. Stop strings are looked for
        once the output holds more than sampling.min_tokens tokens (as vLLM)."""
        stop = self.stop
        floor = self.sampling.min_tokens if self.sampling is not None else 0
        for i, tok in enumerate(tokens):
            self.output.append(tok)
            if not stop.ignore_eos and tok in stop.eos_ids:
                self.finish_reason = "eos"
            elif len(self.output) > floor and stop.hits_stop_string(self.output):
                self.finish_reason = "stop"
            elif stop.max_new_tokens is not None and len(self.output) >= stop.max_new_tokens:
                self.finish_reason = "max_new_tokens"
            elif stop.max_length is not None and len(self) >= stop.max_length:
                self.finish_reason = "max_length"
            if self.finish_reason is not None:
                return tokens[: i + 1]
        return list(tokens)


# ---- what a speculative step can serve ------------------------------------------------------------------------
def shared_rule(seqs: list[Sequence]) -> SamplingConfig | None:
    """The one sampling rule of the scheduled sequences (seed aside), or None when they differ or when a sequence
    needs what only a plain step gives: logprobs (the host sees the logits of plain steps only), penalties (the
    target distribution would depend on the tokens accepted earlier in the same block), min-p or logit_bias (the
    compiled speculation graphs take temperature / top-k / top-p only), min_tokens while the output is shorter
    (the stop ids are held back on the host) or a grammar's mask (structured output: the mask of each position
    depends on the tokens before it, and the caller gives one per step)."""
    if any(plain_only(s) for s in seqs):
        return None
    rules = {(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p) if not s.sampling.greedy else "greedy"
             for s in seqs}
    if len(rules) != 1:
        return None
    first = seqs[0].sampling
    return SamplingConfig() if first.greedy else dataclasses.replace(first, seed=None)


def plain_only(s: Sequence) -> bool:
    """Needs what only a plain step gives: logprobs, penalties, min-p, logit_bias, min_tokens not yet reached or a
    grammar's mask (see shared_rule)."""
    c = s.sampling
    return (s.logprobs is not None or c.penalized or c.min_p > 0 or bool(c.logit_bias)
            or len(s.output) < c.min_tokens or s.allowed is not None or s.grammar is not None)
