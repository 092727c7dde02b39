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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from neuron_infer import cpu_threads
from neuron_infer.compile.artifact import Manifest, read_manifest
from neuron_infer.compile.builder import cache_shape, compile_model  # noqa: F401  (re-exported)
from neuron_infer.compile.quantize_step import quant_structure
from neuron_infer.compile.weights import empty_model, load_rank_weights
from neuron_infer.config import BuildConfig, SamplingConfig  # noqa: F401  (BuildConfig re-exported)
from neuron_infer.errors import ArtifactError, NeuronInferError
from neuron_infer.model.llama import BucketStep
from neuron_infer.prompts import refuse_empty
from neuron_infer.runtime.engine import Engine, planned_graphs
from neuron_infer.runtime.generate import Metrics, SequenceResult, generate_ids


@dataclass
class TextOutput:
    token_ids: list[int]
    text: str
    finish_reason: str

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}


@dataclass
class GenerationOutput:
    outputs: list[TextOutput]
    metrics: list[Metrics]  # one per static batch that ran

    @property
    def ttft_s(self) -> float:
        """Time to the first token of the first batch (seconds)."""
        return self.metrics[0].ttft_s if self.metrics else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase tokens per second, averaged over the batches that ran."""
        m = self.metrics
        return sum(b.tokens_per_s for b in m) / len(m) if m else 0.0

    @property
    def ms_per_token(self) -> float:
        """Mean latency of one decode step (a speculative step emits several tokens: per each batch's count)."""
        from neuron_infer.runtime.spec_engine import summarize  # noqa: PLC0415

        m = self.metrics
        if m and summarize(m) is not None:
            return sum(b.ms_per_token for b in m) / len(m)
        steps = [x for b in m for x in b.token_latencies_s]
        return 1000.0 * sum(steps) / len(steps) if steps else 0.0

    def to_dict(self) -> dict:
        from neuron_infer.runtime.spec_engine import summarize  # noqa: PLC0415

        m = self.metrics
        out = {
            "outputs": [o.to_dict() for o in self.outputs],
            "metrics": {
                "ttft_s": self.ttft_s,
                "ms_per_token": self.ms_per_token,
                "tokens_per_s": self.tokens_per_s,
                "token_latencies_s": [x for b in m for x in b.token_latencies_s],
                "batches": [b.to_dict() for b in m],
            },
        }
        spec = summarize(m)
        if spec is not None:
            out["metrics"]["speculation"] = spec
        return out


def _load_graphs(root: Path, manifest: Manifest, model) -> dict:
    from neuron_infer.compile.backend import get_backend  # noqa: PLC0415

    be = get_backend(manifest.backend)
    graphs = {}
    for spec in planned_graphs(manifest.build):
        step = BucketStep(model, spec.attend, spec.select_rows)
        graphs[spec.name] = be.load_graph(root / "graphs", spec.name, step)
    return graphs


def _eos_ids(manifest: Manifest, tokenizer, root: Path) -> tuple[int, ...]:
    ids = set(manifest.model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = root / "tokenizer" / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


class CompiledModel:
    """A loaded artifact: tokenizer + engine (weights and compiled graphs)."""

    def __init__(self, root: Path, manifest: Manifest, engine: Engine, tokenizer, spec=None):
        self.root, self.manifest, self.engine, self.tokenizer = root, manifest, engine, tokenizer
        self.spec = spec  # runtime.spec_engine.SpecEngine when compiled with --draft-model, else None
        self.eos_ids = _eos_ids(manifest, tokenizer, root)

    @classmethod
    def load(cls, artifact_dir: str | Path, verify_files: bool = True,
             expect_checkpoint: str | Path | None = None, threads: int | str | None = None,
             tokenizer=None) -> "CompiledModel":
        """Load an artifact; with `expect_checkpoint`, also require that it was compiled from that checkpoint.

        threads: CPU threads of the graphs: "auto" follows the CPUs other processes leave free (see
        neuron_infer.cpu_threads), an int fixes the count, None leaves torch's setting alone. Tensor-parallel
        ranks always choose their own ("auto" within their share of the CPUs).
        tokenizer: one already loaded from this artifact's tokenizer/ directory (saves loading it again).
        """
        from neuron_infer.checkpoint import load_tokenizer  # noqa: PLC0415

        if threads is not None:
            cpu_threads.use(threads)  # validated before the slow load
        root = Path(artifact_dir)
        manifest = read_manifest(root, verify_files=verify_files)
        if expect_checkpoint is not None:
            check_checkpoint(manifest, root, Path(expect_checkpoint))
        if manifest.build.tp_degree != 1:  # shards live in rank processes (neuron_infer.parallel.runtime)
            from neuron_infer.parallel.runtime import TPCompiledModel  # noqa: PLC0415

            return TPCompiledModel.from_manifest(root, manifest)
        model = empty_model(manifest.model, manifest.build)
        quant_structure(model, manifest.build)
        load_rank_weights(model, root / "weights" / "rank0.safetensors")
        engine = Engine(_load_graphs(root, manifest, model), manifest.build, cache_shape(model, manifest.build),
                        manifest.model.vocab_size)
        spec = None
        if manifest.build.speculation is not None:
            from neuron_infer.compile.spec_builder import load_speculation  # noqa: PLC0415

            spec = load_speculation(root, manifest, model, engine)
        return cls(root, manifest, engine, tokenizer or load_tokenizer(root / "tokenizer"), spec)

    @classmethod
    def default(cls, build: BuildConfig | None = None, threads: int | str | None = None,
                say: Callable[[str], None] | None = None) -> "CompiledModel":
        """The embedded default model (SmolLM2-135M-Instruct), compiled once into the cache and loaded.

        `build` defaults to the `smollm2-cpu` preset (the CLI's default); `say` receives progress lines.
        """
        from neuron_infer.presets import DEFAULT_PRESET, default_artifact_dir, load_preset  # noqa: PLC0415

        build = build or load_preset(DEFAULT_PRESET).build
        return cls.load(default_artifact_dir(build, say or (lambda _msg: None)), threads=threads)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt`; with `chat`, of a one-message conversation through the chat template."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate_chat(self, messages: list[dict[str, str]], max_new_tokens: int = 64,
                      sampling: SamplingConfig = SamplingConfig(), ignore_eos: bool = False,
                      on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationOutput:
        """The assistant's next message after `messages` ([{"role": "system"|"user"|"assistant", "content"}])."""
        ids = encode_chat(self.tokenizer, messages)
        return self.generate_ids([ids], max_new_tokens, sampling, ignore_eos, on_tokens)

    def generate(self, prompts: list[str], max_new_tokens: int = 64, sampling: SamplingConfig = SamplingConfig(),
                 chat: bool = False, ignore_eos: bool = False,
                 on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationOutput:
        refuse_empty((f"prompt {i}", p) for i, p in enumerate(prompts))
        ids = [self.encode(p, chat) for p in prompts]
        return self.generate_ids(ids, max_new_tokens, sampling, ignore_eos, on_tokens)

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 64,
                     sampling: SamplingConfig = SamplingConfig(), ignore_eos: bool = False,
                     on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationOutput:
        if max_new_tokens < 1:
            raise NeuronInferError(f"max_new_tokens={max_new_tokens} must be >= 1")
        check_token_ids(prompts, self.manifest.model.vocab_size)
        bs, outputs, metrics = self.manifest.build.batch_size, [], []
        for start in range(0, len(prompts), bs):
            chunk = prompts[start:start + bs]
            if self.spec is not None:
                res, m = self.spec.generate_ids(chunk, max_new_tokens, sampling, self.eos_ids, ignore_eos, on_tokens)
            else:
                res, m = generate_ids(self.engine, chunk, max_new_tokens, sampling, self.eos_ids, ignore_eos,
                                      on_tokens)
            outputs += [self._text(r) for r in res]
            metrics.append(m)
        return GenerationOutput(outputs, metrics)

    def _text(self, r: SequenceResult) -> TextOutput:
        return TextOutput(r.token_ids, self.tokenizer.decode(r.token_ids, skip_special_tokens=True), r.finish_reason)


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    """Refuse ids the embedding has no row for (eager graphs raise IndexError, compiled ones abort the process)."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise NeuronInferError(f"prompt {i} holds token id {bad[0]}, outside this model's vocabulary "
                                   f"0..{vocab_size - 1}; encode prompts with the artifact's own tokenizer")


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a plain prompt, or (chat) of one user message through the tokenizer's chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation through the chat template, ending with the assistant's turn header."""
    if not getattr(tokenizer, "chat_template", None):
        raise NeuronInferError("this model's tokenizer has no chat template: chat needs one (use --prompt "
                               "without --chat for plain completion)")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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


def check_checkpoint(manifest: Manifest, root: Path, model_dir: Path) -> None:
    from neuron_infer.checkpoint import checkpoint_fingerprint  # noqa: PLC0415

    found = checkpoint_fingerprint(model_dir)
    if found != manifest.checkpoint_fingerprint:
        raise ArtifactError(
            f"{root / 'manifest.json'}: checkpoint_fingerprint {manifest.checkpoint_fingerprint[:12]}... does not match "
            f"{model_dir} ({found[:12]}...): the artifact was compiled from another checkpoint; recompile it"
        )
