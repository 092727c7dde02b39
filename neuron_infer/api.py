"""Python API: the same capabilities as the CLI.

```python
from neuron_infer.api import BuildConfig, CompiledModel, SamplingConfig, compile_model

compile_model("path/to/hf-model", "artifacts/m", BuildConfig(dtype="bf16", max_context_length=64, max_length=128))
m = CompiledModel.load("artifacts/m", threads=1)
out = m.generate(["The capital of France is"], max_new_tokens=16)
print(out.outputs[0].text, f"{out.tokens_per_s:.1f} tokens/s")
chat = m.generate_chat([{"role": "user", "content": "Hi!"}], max_new_tokens=8,
                       sampling=SamplingConfig(temperature=0.7, top_p=0.9, seed=0))
print(chat.outputs[0].text)
```
(tests/test_docs.py runs this example against a tiny checkpoint.)

`CompiledModel.default()` is the one-line entry to the embedded default model: it compiles it once into the
cache (`$NEURON_INFER_CACHE`, else `~/.cache/neuron-infer`), exactly as `neuron-infer generate` without ARTIFACTS
does, and loads it.
"""
from __future__ import annotations

import os
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from neuron_infer import cpu_threads
from neuron_infer.artifact.manifest import (
    TOKENIZER_DIR,
    Manifest,
    check_checkpoint,
    check_digest,
    check_files,
    load_verified_tokenizer,
    read_manifest,
    verified_generation_config,
)
from neuron_infer.chat_template import render_chat
from neuron_infer.checkpoint import generation_eos_ids
from neuron_infer.compile.builder import compile_model  # noqa: F401  (re-exported)
from neuron_infer.config import BuildConfig, SamplingConfig  # noqa: F401  (BuildConfig re-exported)
from neuron_infer.errors import ArtifactError, NeuronInferError
from neuron_infer.model.sampling import check_vocab
from neuron_infer.presets import EMBEDDED_PRESET, default_artifact_dir, load_preset
from neuron_infer.prompts import check_sizes, refuse_empty
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import SequenceResult, generate_ids
from neuron_infer.runtime.grammar import GrammarSpec, check_ends_at_eos, token_grammar
from neuron_infer.runtime.loader import load_rank
from neuron_infer.runtime.metrics import Metrics, pooled
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.rank_group import RankGroup
from neuron_infer.runtime.sequence import Sequence, StopRule, check_prompt, cut_at_stop
from neuron_infer.runtime.speculation import Speculation, split
from neuron_infer.text_input import check_path, check_text

OnTokens = Callable[[list[list[int]]], None]


@dataclass
class TextOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" (a stop string; text cut before it) | "max_new_tokens" | "max_length"
    logprobs: list[dict] | None = None  # per token: {"token_id", "token", "logprob", "top": [{"token_id", ...}]}

    def to_dict(self) -> dict:
        d = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d


@dataclass
class GenerationOutput:
    outputs: list[TextOutput]
    metrics: list[Metrics]  # one per generate call (a list: pooled() also reads several)

    @property
    def ttft_s(self) -> float:
        """Time to the first token (seconds)."""
        return pooled(self.metrics)["ttft_s"]

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase tokens per second."""
        return pooled(self.metrics)["tokens_per_s"]

    @property
    def ms_per_token(self) -> float:
        """Mean latency of one decode step (a speculative step emits several tokens)."""
        return pooled(self.metrics)["ms_per_token"]

    def to_dict(self) -> dict:
        return {"outputs": [o.to_dict() for o in self.outputs], "metrics": pooled(self.metrics)}


def _eos_ids(manifest: Manifest, tokenizer, root: Path) -> tuple[int, ...]:
    ids = set(manifest.model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    raw = verified_generation_config(root, manifest)  # read once: the bytes checked are the bytes parsed
    if raw is not None:
        ids.update(generation_eos_ids(root / TOKENIZER_DIR / "generation_config.json", manifest.model.vocab_size,
                                      "recompile the model", ArtifactError, raw=raw))
    return tuple(sorted(ids))


LOAD_STAGES = ("verifying the files", "tokenizer", "weights and graphs")


class CompiledModel:
    """A loaded artifact: tokenizer + engine (weights and compiled graphs), or, for a tensor-parallel CPU artifact,
    the rank group whose processes hold the shards (started at load; `close()` or `with` stops them)."""

    def __init__(self, root: Path, manifest: Manifest, model: Engine | Speculation | None, tokenizer, group=None):
        """model: what load_rank gave (None for a rank group); split into `engine` and `spec`, the speculation
        strategy when compiled with --draft-model."""
        self.root, self.manifest, self.tokenizer = root, manifest, tokenizer
        self.engine, self.spec = split(model) if model is not None else (None, None)
        self.group = group  # runtime.rank_group.RankGroup for a tp > 1 CPU artifact, else None
        self.eos_ids = _eos_ids(manifest, tokenizer, root)
        self.options = RunOptions()  # prefix caching, chunked prefill, speculation gate (`load` sets them)

    @classmethod
    def load(cls, artifact_dir: str | Path, verify_files: bool = True,
             expect_checkpoint: str | Path | None = None, threads: int | str | None = None,
             tokenizer=None, on_stage: Callable[[str], None] = lambda _stage: None,
             kv_cache_gib: float | None = None, prefix_caching: bool = True,
             prefill_chunk: int | None = None, speculation_gate: bool = True,
             expect_digest: str | None = None) -> CompiledModel:
        """Load an artifact; with `expect_checkpoint`, also require that it was compiled from that checkpoint.

        threads: CPU threads of the graphs: "auto" follows the CPUs other processes leave free (see
        neuron_infer.cpu_threads), an int fixes the count, None leaves torch's setting alone. Tensor-parallel
        ranks always choose their own ("auto" within their share of the CPUs).
        tokenizer: one already loaded from this artifact's tokenizer/ directory (saves loading it again).
        on_stage: called with each of LOAD_STAGES as it starts (the CLI shows them as a progress bar).
        kv_cache_gib: KV-cache memory per rank (None: the build's batch_size sequences of max_length);
        prefix_caching: reuse the cached blocks of prompts that start like an earlier one (see docs/kv-cache.md);
        prefill_chunk: prompt tokens encoded per step while other prompts decode (None: the default, 0: whole
        prompts; see docs/kv-cache.md).
        speculation_gate: with a draft model, take plain steps while speculative steps are measured not to pay
        (False: speculate on every step that can, e.g. to measure speculation at a fixed k; docs/speculation.md).
        expect_digest: the artifact's digest (the sha256 of its manifest.json, which `neuron-infer info` prints):
        any other manifest is refused before anything in the artifact is used (docs/security.md).
        """
        root = Path(check_path(artifact_dir, "artifact_dir"))
        if not callable(on_stage):
            raise NeuronInferError(f"on_stage={on_stage!r} must be a callable")
        if tokenizer is not None and (isinstance(tokenizer, str | bytes) or not hasattr(tokenizer, "eos_token_id")
                                      or not callable(getattr(tokenizer, "encode", None))):
            raise NeuronInferError(f"tokenizer={reprlib.repr(tokenizer)} must be a tokenizer (the one "
                                   "load_verified_tokenizer returns), or None to load the artifact's own")
        options = RunOptions(prefix_caching, prefill_chunk, speculation_gate)  # checked before the slow load
        check_kv_cache_gib(kv_cache_gib)
        if expect_digest is not None:
            expect_digest = check_digest(expect_digest)
            if not verify_files:  # the digest pins the files through their hashes in the manifest
                raise NeuronInferError("expect_digest pins the artifact's files through the manifest's sha256 of "
                                       "each: it needs verify_files=True")
        if threads is not None:
            cpu_threads.use(threads)  # validated before the slow load
        on_stage(LOAD_STAGES[0])
        manifest = read_manifest(root, verify_files=verify_files, expect_digest=expect_digest)
        if expect_checkpoint is not None:
            check_checkpoint(manifest, root, Path(expect_checkpoint))
        on_stage(LOAD_STAGES[1])
        if not verify_files:  # the tokenizer files (chat template, generation config) are verified in any case
            check_files(root, manifest, TOKENIZER_DIR)
        tokenizer = tokenizer or load_verified_tokenizer(root, manifest)
        on_stage(LOAD_STAGES[2])
        if manifest.build.tp_degree != 1 and manifest.backend != "neuron":  # shards live in rank processes
            model = cls(root, manifest, None, tokenizer, RankGroup(root, manifest, kv_cache_gib, options))
        else:
            model = cls(root, manifest, load_rank(root, 0, manifest, kv_cache_gib=kv_cache_gib), tokenizer)
        model.options = options
        return model

    @classmethod
    def default(cls, build: BuildConfig | None = None, threads: int | str | None = None,
                say: Callable[[str], None] | None = None) -> CompiledModel:
        """The embedded default model (SmolLM2-135M-Instruct), compiled once into the cache and loaded.

        `build` defaults to the `smollm2-cpu` preset (the CLI's default); `say` receives progress lines.
        """
        build = build or load_preset(EMBEDDED_PRESET).build
        return cls.load(default_artifact_dir(build, say or (lambda _msg: None)), threads=threads)

    def close(self) -> None:
        """Stop the rank processes of a tensor-parallel CPU artifact (started at load, reused by every generate
        call; also stopped at garbage collection and interpreter exit). Idempotent; a no-op for other artifacts."""
        if self.group is not None:
            self.group.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt`; with `chat`, of a one-message conversation through the chat template."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate_chat(self, messages: list[dict[str, str]], max_new_tokens: int = 64,
                      sampling: SamplingConfig = SamplingConfig(), ignore_eos: bool = False,  # noqa: B008
                      on_tokens: OnTokens | None = None, stop: tuple[str, ...] = (),
                      logprobs: int | None = None) -> GenerationOutput:
        """The assistant's next message after `messages` ([{"role": "system"|"user"|"assistant", "content"}])."""
        ids = encode_chat(self.tokenizer, messages)
        return self.generate_ids([ids], max_new_tokens, sampling, ignore_eos, on_tokens, stop=stop,
                                 logprobs=logprobs)

    def generate(self, prompts: list[str], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen, never mutated)
                 chat: bool = False, ignore_eos: bool = False, on_tokens: OnTokens | None = None,
                 stop: tuple[str, ...] = (), logprobs: int | None = None,
                 grammar: GrammarSpec | None = None) -> GenerationOutput:
        """Generate text. `stop`: stop strings (a sequence stops when its output contains one; the text is cut
        before it, finish_reason "stop"); `logprobs`: each output token's logprob and the top-N alternatives;
        `grammar`: structured output (see `generate_ids`)."""
        if isinstance(prompts, str) or not isinstance(prompts, list | tuple):
            raise NeuronInferError(f"prompts must be a list of strings, not {type(prompts).__name__} (for one prompt: "
                                   "[prompt])")
        check_call_args(sampling, {"chat": chat, "ignore_eos": ignore_eos}, on_tokens)
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise NeuronInferError(f"prompt {i} is a {type(p).__name__}, not a string")
            check_text(p, f"prompt {i}")
        refuse_empty((f"prompt {i}", p) for i, p in enumerate(prompts))
        check_sizes(prompts, self.manifest.build.max_context_length)
        ids = [self.encode(p, chat) for p in prompts]
        return self.generate_ids(ids, max_new_tokens, sampling, ignore_eos, on_tokens, stop=stop, logprobs=logprobs,
                                 grammar=grammar)

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 64,
                     sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen, never mutated)
                     ignore_eos: bool = False, on_tokens: OnTokens | None = None,
                     collect_logits: bool = False, stop: tuple[str, ...] = (),
                     logprobs: int | None = None, grammar: GrammarSpec | None = None) -> GenerationOutput:
        """Generate from token ids (`stop`, `logprobs`: see `generate`). `collect_logits` (tensor-parallel rank
        groups): keep each step's logits in `self.group.last_run["logits"]` (tests compare them against tp = 1).
        Under torchrun, ranks other than 0 return an empty GenerationOutput (rank 0 holds the results). `grammar`:
        structured output (a JSON schema, regex or choices, runtime/grammar.py; each output ends with EOS once the
        grammar is complete)."""
        check_generate_args(prompts, max_new_tokens, stop, logprobs)
        check_call_args(sampling, {"ignore_eos": ignore_eos, "collect_logits": collect_logits}, on_tokens)
        rule = StopRule(stop_strings=tuple(stop), decode=self._decode)
        check_vocab(sampling, self.manifest.model.vocab_size)
        make_grammar = self._grammar(grammar, ignore_eos)
        if self.group is not None:  # checked here too: a rank's error would name no prompt of the caller
            if logprobs is not None or grammar is not None:
                raise NeuronInferError("logprobs and structured output are not available for tensor-parallel CPU "
                                       "artifacts yet; use a tp=1 artifact")
            for i, p in enumerate(prompts):
                check_prompt(f"prompt {i}", p, self.manifest.build.max_context_length, self.manifest.model.vocab_size)
            got = self.group.generate_ids(prompts, max_new_tokens, sampling, self.eos_ids, ignore_eos, on_tokens,
                                          collect_logits)
            if got is None:
                return GenerationOutput([], [])
            return GenerationOutput([self._text(_apply_stop(r, rule, sampling), rule) for r in got[0]], got[1])
        res, m = generate_ids(self.spec if self.spec is not None else self.engine, prompts, max_new_tokens, sampling, self.eos_ids, ignore_eos, on_tokens,
                              stop=rule, logprobs=logprobs, options=self.options, grammar=make_grammar)
        return GenerationOutput([self._text(r, rule) for r in res], [m])

    def _grammar(self, spec: GrammarSpec | None, ignore_eos: bool):
        """The per-sequence grammar factory of `spec` (None: unconstrained)."""
        check_ends_at_eos(spec, ignore_eos)
        if spec is None:
            return None
        return token_grammar(spec, self.tokenizer, self.manifest.model.vocab_size, self.eos_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, r: SequenceResult, rule: StopRule) -> TextOutput:
        text = self._decode(r.token_ids)
        if r.finish_reason == "stop":
            text = cut_at_stop(text, rule.stop_strings)
        lps = None
        if r.logprobs is not None:
            def tok(i: int) -> str:
                return self.tokenizer.decode([i])

            lps = [{"token_id": e["token_id"], "token": tok(e["token_id"]), "logprob": e["logprob"],
                    "top": [{"token_id": i, "token": tok(i), "logprob": v} for i, v in e["top"]]} for e in r.logprobs]
        return TextOutput(r.token_ids, text, r.finish_reason, lps)


def _apply_stop(r: SequenceResult, rule: StopRule, sampling: SamplingConfig) -> SequenceResult:
    """A rank group's result under the stop strings (the ranks generate without them): the same stop rule, replayed
    over the tokens (the tokens after a stop string are dropped; none within min_tokens)."""
    if not rule.stop_strings:
        return r
    seq = Sequence(0, [], sampling, rule, None)
    kept = seq.append(r.token_ids)
    return SequenceResult(kept, "stop") if seq.finished else r


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a plain prompt, or (chat) of one user message through the tokenizer's chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation through the chat template (rendered under limits: neuron_infer.chat_template),
    ending with the assistant's turn header."""
    check_messages(messages)
    text = render_chat(tokenizer, messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_generate_args(prompts, max_new_tokens, stop, logprobs) -> None:
    """The types and ranges of generate_ids' arguments, each problem a NeuronInferError naming it."""
    if not isinstance(prompts, list | tuple) or not all(isinstance(p, list | tuple) for p in prompts):
        raise NeuronInferError("prompts must be a list of token-id lists, e.g. [[1, 15, 7]]")
    for i, p in enumerate(prompts):
        bad = next((t for t in p if not _is_int(t)), None)
        if bad is not None:
            raise NeuronInferError(f"prompt {i} holds {bad!r}, not an integer token id")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise NeuronInferError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if isinstance(stop, str) or not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise NeuronInferError(f"stop={stop!r} must be a list of non-empty strings (for one: [{stop!r}])"
                               if isinstance(stop, str) else f"stop={stop!r} must be a list of non-empty strings")
    if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
        raise NeuronInferError(f"logprobs={logprobs!r} must be None or an integer >= 0")


def check_call_args(sampling, flags: dict[str, Any], on_tokens) -> None:
    """The types of the other generate arguments: a SamplingConfig, true/false flags, a callable (or None)."""
    if not isinstance(sampling, SamplingConfig):
        raise NeuronInferError(f"sampling must be a SamplingConfig (e.g. SamplingConfig(temperature=0.7)), not "
                               f"{type(sampling).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise NeuronInferError(f"{name}={value!r} must be True or False")
    if on_tokens is not None and not callable(on_tokens):
        raise NeuronInferError(f"on_tokens={on_tokens!r} must be a callable or None")


def check_messages(messages) -> None:
    """A conversation: a non-empty list of {"role": str, "content": str} dicts."""
    if isinstance(messages, str) or not isinstance(messages, list | tuple) or not messages:
        raise NeuronInferError('messages must be a non-empty list of {"role": ..., "content": ...} dicts, not '
                               f"{reprlib.repr(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise NeuronInferError(f'messages[{i}] must be a dict with a string "role" and a string "content", not '
                                   f"{reprlib.repr(m)}")
        check_text(m["role"], f"messages[{i}] role")
        check_text(m["content"], f"messages[{i}] content")


def check_kv_cache_gib(gib) -> None:
    """None, or a finite number of GiB above 0 and at most the machine's memory."""
    if gib is None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 < gib <= total:  # NaN compares False
        raise NeuronInferError(f"--kv-cache-gib {gib!r} must be a number above 0 and at most this machine's memory "
                               f"({total:.1f} GiB)")


def check_request(build: BuildConfig, prompt_lengths: list[int], max_new_tokens: int | None) -> None:
    """Checks that need only the manifest and the tokenizer, run before the slow load of weights and graphs.

    `max_new_tokens=None` means "as many as fit" (nothing to check).
    """
    if max_new_tokens is not None and max_new_tokens < 1:
        raise NeuronInferError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    for i, n in enumerate(prompt_lengths):
        if n > build.max_context_length:
            raise NeuronInferError(
                f"prompt {i} has {n} tokens, more than max_context_length={build.max_context_length}; shorten it "
                "or recompile with a larger --max-context-length")
        if max_new_tokens is not None and n + max_new_tokens > build.max_length:
            raise NeuronInferError(
                f"prompt {i} has {n} tokens: with --max-new-tokens {max_new_tokens} it needs {n + max_new_tokens} "
                f"positions, more than max_length={build.max_length}; use --max-new-tokens <= "
                f"{max(build.max_length - n, 0)} or recompile with a larger --max-length")
