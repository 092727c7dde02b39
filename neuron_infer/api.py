"""Python API: the same capabilities as the CLI.

    from neuron_infer.api import compile_model, CompiledModel
    compile_model("path/to/hf-model", "artifacts/m", BuildConfig(dtype="bf16"))
    m = CompiledModel.load("artifacts/m")
    out = m.generate(["The capital of France is"], max_new_tokens=16)
    print(out.outputs[0].text, out.metrics.tokens_per_s)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from neuron_infer.compile.artifact import Manifest, read_manifest
from neuron_infer.compile.builder import cache_shape, compile_model  # noqa: F401  (re-exported)
from neuron_infer.compile.quantize_step import quant_structure
from neuron_infer.compile.weights import empty_model, load_rank_weights
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ArtifactError, NeuronInferError
from neuron_infer.model.llama import BucketStep
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

    def to_dict(self) -> dict:
        from neuron_infer.runtime.spec_engine import summarize  # noqa: PLC0415

        m = self.metrics
        steps = [x for b in m for x in b.token_latencies_s]
        spec = summarize(m)  # a speculative step emits several tokens: ms/token comes from each batch's count
        ms = sum(b.ms_per_token for b in m) / len(m) if (spec and m) else None
        out = {
            "outputs": [o.to_dict() for o in self.outputs],
            "metrics": {
                "ttft_s": m[0].ttft_s if m else 0.0,
                "ms_per_token": ms if ms is not None else (1000.0 * sum(steps) / len(steps) if steps else 0.0),
                "tokens_per_s": sum(b.tokens_per_s for b in m) / len(m) if m else 0.0,
                "token_latencies_s": steps,
                "batches": [b.to_dict() for b in m],
            },
        }
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


LOAD_STAGES = ("verifying the files", "weights", "graphs", "tokenizer")


class CompiledModel:
    """A loaded artifact: tokenizer + engine (weights and compiled graphs)."""

    def __init__(self, root: Path, manifest: Manifest, engine: Engine, tokenizer, spec=None):
        self.root, self.manifest, self.engine, self.tokenizer = root, manifest, engine, tokenizer
        self.spec = spec  # runtime.spec_engine.SpecEngine when compiled with --draft-model, else None
        self.eos_ids = _eos_ids(manifest, tokenizer, root)

    @classmethod
    def load(cls, artifact_dir: str | Path, verify_files: bool = True,
             expect_checkpoint: str | Path | None = None,
             on_stage: Callable[[str], None] = lambda _stage: None) -> "CompiledModel":
        """Load an artifact; with `expect_checkpoint`, also require that it was compiled from that checkpoint.
        `on_stage` is called with each of LOAD_STAGES as it starts (the CLI shows them as a progress bar)."""
        from neuron_infer.checkpoint import load_tokenizer  # noqa: PLC0415

        root = Path(artifact_dir)
        on_stage(LOAD_STAGES[0])
        manifest = read_manifest(root, verify_files=verify_files)
        if expect_checkpoint is not None:
            check_checkpoint(manifest, root, Path(expect_checkpoint))
        if manifest.build.tp_degree != 1:  # shards live in rank processes (neuron_infer.parallel.runtime)
            from neuron_infer.parallel.runtime import TPCompiledModel  # noqa: PLC0415

            return TPCompiledModel.from_manifest(root, manifest)
        on_stage(LOAD_STAGES[1])
        model = empty_model(manifest.model, manifest.build)
        quant_structure(model, manifest.build)
        load_rank_weights(model, root / "weights" / "rank0.safetensors")
        on_stage(LOAD_STAGES[2])
        engine = Engine(_load_graphs(root, manifest, model), manifest.build, cache_shape(model, manifest.build),
                        manifest.model.vocab_size)
        spec = None
        if manifest.build.speculation is not None:
            from neuron_infer.compile.spec_builder import load_speculation  # noqa: PLC0415

            spec = load_speculation(root, manifest, model, engine)
        on_stage(LOAD_STAGES[3])
        return cls(root, manifest, engine, load_tokenizer(root / "tokenizer"), spec)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise NeuronInferError("--chat: this model's tokenizer has no chat template; drop --chat")
            msgs = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(self, prompts: list[str], max_new_tokens: int = 64, sampling: SamplingConfig = SamplingConfig(),
                 chat: bool = False, ignore_eos: bool = False,
                 on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationOutput:
        ids = [self.encode(p, chat) for p in prompts]
        return self.generate_ids(ids, max_new_tokens, sampling, ignore_eos, on_tokens)

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 64,
                     sampling: SamplingConfig = SamplingConfig(), ignore_eos: bool = False,
                     on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationOutput:
        if max_new_tokens < 1:
            raise NeuronInferError(f"max_new_tokens={max_new_tokens} must be >= 1")
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


def check_checkpoint(manifest: Manifest, root: Path, model_dir: Path) -> None:
    from neuron_infer.checkpoint import checkpoint_fingerprint  # noqa: PLC0415

    found = checkpoint_fingerprint(model_dir)
    if found != manifest.checkpoint_fingerprint:
        raise ArtifactError(
            f"{root / 'manifest.json'}: checkpoint_fingerprint {manifest.checkpoint_fingerprint[:12]}... does not match "
            f"{model_dir} ({found[:12]}...): the artifact was compiled from another checkpoint; recompile it"
        )
