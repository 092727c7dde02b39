"""vLLM request parameters -> neuron-infer sampling; unsupported features are rejected with a clear message.

Pure functions over duck-typed `SamplingParams` (attribute access only), so they are unit-tested without vLLM.
Stop strings, stop token ids, EOS, ignore_eos, max_tokens and `n` are handled by vLLM's scheduler and detokenizer
and work unchanged. Sample logprobs (`logprobs`) are computed by the runtime's Runner from the logits it samples
from (raw log-softmax, vLLM's default `logprobs_mode`). `logit_bias` (vLLM has already clamped it to [-100, 100]
and checked its ids against the vocabulary) and `min_tokens` (its stop ids: `all_stop_token_ids`, as vLLM's own
logits processor) go to the runtime's one sampling definition; everything else that would need this runner to change
or report logits (bad_words, allowed_token_ids, ...) is refused up front. Structured outputs (json, json_object,
regex, choice, grammar) are vLLM's: its scheduler compiles the grammar and computes each step's token bitmask, the
worker applies it in the runtime's sampling (`Sequence.allowed`). Prompt logprobs (`prompt_logprobs`, and the OpenAI
`echo` with `logprobs`, which vLLM's front end turns into prompt logprobs) are scored by the Runner as it encodes
the prompt.
"""
from __future__ import annotations

from typing import Any

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ConfigError

GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy

# attribute -> (value that means "off", what to tell the user)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logprob_token_ids": (None, "logprob_token_ids"),
    "prompt_logprob_token_ids": (None, "prompt_logprob_token_ids"),
    "allowed_token_ids": (None, "allowed_token_ids"),
    "bad_words": (None, "bad_words"),
    "thinking_token_budget": (None, "thinking_token_budget"),
    "repetition_detection": (None, "repetition_detection"),
    "trace_decode_token_ids": (None, "trace_decode_token_ids"),
    "watermarking": (None, "watermarking"),
}


class UnsupportedRequestError(ValueError):
    """A request feature the neuron-infer runner does not implement (vLLM answers it with HTTP 400)."""


def unsupported_features(params: Any) -> list[str]:
    """Names of the features `params` asks for that the neuron-infer runner does not implement."""
    found = []
    for attr, (off, name) in _UNSUPPORTED.items():
        value = getattr(params, attr, off)
        if value is not None and value is not False and value != off and not (isinstance(value, (list, dict)) and not value):
            found.append(f"{name}={value!r}")
    if getattr(params, "extra_args", None):
        found.append(f"extra_args={params.extra_args!r}")
    return found


def check_request(params: Any, prompt_len: int | None = None, max_prompt_len: int | None = None) -> None:
    """Raise UnsupportedRequestError naming every unsupported feature of one request (None for pooling)."""
    if params is None or not hasattr(params, "temperature"):
        raise UnsupportedRequestError("the neuron-infer vLLM plugin serves text generation only (no pooling/embed)")
    found = unsupported_features(params)
    if found:
        raise UnsupportedRequestError(
            f"the neuron-infer vLLM plugin does not support {', '.join(found)}; remove "
            f"{'it' if len(found) == 1 else 'them'} from the request (supported: temperature, top_k, top_p, min_p, "
            "seed, repetition/presence/frequency penalties, min_tokens, logit_bias, logprobs, prompt_logprobs, "
            "structured outputs, "
            "max_tokens, stop, stop_token_ids, ignore_eos, n), or serve this model without NEURON_INFER_VLLM=1"
        )
    try:
        to_sampling_config(params)
    except ConfigError as e:
        raise UnsupportedRequestError(f"the neuron-infer vLLM plugin cannot serve this request: {e}") from e
    if prompt_len is not None and max_prompt_len is not None and prompt_len > max_prompt_len:
        raise UnsupportedRequestError(
            f"the prompt has {prompt_len} tokens but the neuron-infer artifact encodes at most {max_prompt_len} "
            "(its max_context_length); shorten the prompt or recompile with a larger max_context_length"
        )


def to_sampling_config(params: Any) -> SamplingConfig:
    """vLLM SamplingParams -> SamplingConfig (top_k <= 0 and top_p 1.0 mean off in both). The penalties apply to
    greedy requests too (as in vLLM), and so do min_tokens and logit_bias; min-p, top-k and top-p only to sampled
    ones."""
    penalties = {"repetition_penalty": float(getattr(params, "repetition_penalty", 1.0)),
                 "presence_penalty": float(getattr(params, "presence_penalty", 0.0)),
                 "frequency_penalty": float(getattr(params, "frequency_penalty", 0.0)),
                 "min_tokens": int(getattr(params, "min_tokens", 0) or 0),
                 "logit_bias": {int(t): float(b) for t, b in (getattr(params, "logit_bias", None) or {}).items()}}
    temperature = float(params.temperature)
    if temperature < GREEDY_EPS:
        return SamplingConfig(temperature=0.0, seed=params.seed, **penalties)
    top_k = int(params.top_k or 0)
    return SamplingConfig(temperature=temperature, top_k=max(top_k, 0), top_p=float(params.top_p), seed=params.seed,
                          min_p=float(getattr(params, "min_p", 0.0)), **penalties)


def requested_logprobs(params: Any, vocab_size: int) -> int | None:
    """How many top alternatives to report per sampled token (None: no logprobs; vLLM's -1 = the whole
    vocabulary). vLLM's front end has already bounded the number by its --max-logprobs."""
    n = getattr(params, "logprobs", None)
    if n is None:
        return None
    return vocab_size if int(n) == -1 else int(n)


def stop_ids(params: Any) -> tuple[int, ...]:
    """The token ids min_tokens holds back: vLLM's `all_stop_token_ids` (EOS and the request's stop_token_ids)."""
    return tuple(sorted(int(t) for t in (getattr(params, "all_stop_token_ids", None) or ())))


def requested_prompt_logprobs(params: Any, vocab_size: int) -> int | None:
    """How many top alternatives to report per prompt token (None: no prompt logprobs; -1 = the whole vocabulary,
    as vLLM's own runner)."""
    n = getattr(params, "prompt_logprobs", None)
    if n is None:
        return None
    return vocab_size if int(n) == -1 else int(n)
