"""Structured output outside vLLM: a JSON schema, a regex or a list of choices held by a per-sequence token grammar.

`GrammarSpec` says what the output must match; `token_grammar` compiles it (xgrammar, the backend vLLM uses, an
optional dependency: `pip install xgrammar`) into a factory of `TokenGrammar`s, one per sequence. Before each
sampled token the Runner asks the sequence's grammar for its mask (`allowed`, bool [V]) and the one sampling
definition sets every other token's logit to -inf; the token sampled is then `accept`ed. Once the grammar is complete
only the stop ids (the tokenizer's EOS and `stop_ids`) are allowed, so the sequence ends with finish_reason "eos".
A constrained sequence takes plain steps (see runtime/runner.py `_plain_only`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from neuron_infer.errors import ConfigError, NeuronInferError
from neuron_infer.model.sampling import unpack_bitmask


@dataclass(frozen=True)
class GrammarSpec:
    """Exactly one of: json_schema (the schema's JSON text), regex (the whole output matches it) or choice (the output
    is one of these strings)."""

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        given = [n for n, v in (("json_schema", self.json_schema), ("regex", self.regex), ("choice", self.choice)) if v]
        if len(given) != 1:
            raise ConfigError(f"structured output takes exactly one of a JSON schema, a regex or choices, got "
                              f"{' and '.join(given) or 'none'}")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
        if any(not isinstance(c, str) or not c for c in self.choice):
            raise ConfigError(f"choices must be non-empty strings, got {list(self.choice)!r}")


def check_ends_at_eos(spec: GrammarSpec | None, ignore_eos: bool) -> None:
    """A grammar ends its output with EOS: refuse ignore_eos next to one."""
    if spec is not None and ignore_eos:
        raise NeuronInferError("structured output ends each output with EOS once its grammar is complete; drop "
                               "ignore_eos (--ignore-eos)")


class TokenGrammar:
    """One sequence's grammar state: `allowed()` -> bool [V] for its next token, `accept(token)` after it."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.v = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        import xgrammar as xgr

        words = xgr.allocate_token_bitmask(1, self.v)  # [1, ceil(V / 32)] int32
        self.matcher.fill_next_token_bitmask(words)
        return unpack_bitmask(words.numpy(), self.v)[0]  # [V]

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(int(token)):
            raise NeuronInferError(f"token {token} does not continue the output's grammar (a token outside the mask "
                                   "was sampled; please report this)")


def token_grammar(spec: GrammarSpec, tokenizer, vocab_size: int, stop_ids: Sequence[int] = ()
                  ) -> Callable[[], TokenGrammar]:
    """Compile `spec` for `tokenizer` (a Hugging Face tokenizer; logits of `vocab_size` entries) -> a factory of
    fresh per-sequence grammars. ConfigError for a schema or regex the compiler refuses; NeuronInferError when
    xgrammar is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise NeuronInferError("structured output (--json-schema, --regex, --choice) needs the xgrammar package: "
                               "pip install xgrammar") from None
    stops = sorted({*([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []), *stop_ids})
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
    compiler = xgr.GrammarCompiler(info)
    try:
        if spec.json_schema is not None:
            compiled = compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        elif spec.regex is not None:
            compiled = compiler.compile_regex(spec.regex)
        else:  # an EBNF alternation of string literals (JSON string escapes are EBNF's)
            compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"structured output: the grammar does not compile: {str(e).splitlines()[0]}") from None
    return lambda: TokenGrammar(xgr.GrammarMatcher(compiled), vocab_size)
