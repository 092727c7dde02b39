"""Python API: the same capabilities as the CLI.

    from neuron_infer.api import compile_model, CompiledModel
    compile_model("path/to/hf-model", "artifacts/m", BuildConfig(dtype="bf16"))
    m = CompiledModel.load("artifacts/m")
    out = m.generate(["The capital of France is"], max_new_tokens=16)
    print(out.outputs[0].text, out.metrics[0].tokens_per_s)
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuron_infer.compile.artifact import Manifest, check_checkpoint, read_manifest
from neuron_infer.compile.builder import compile_model  # noqa: F401  (re-exported)
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.generate import SequenceResult, generate_ids
from neuron_infer.runtime.loader import load_rank
from neuron_infer.runtime.metrics import Metrics, pooled


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
    metrics: list[Metrics]  # one per generate call (a list: pooled() also reads several)

    def to_dict(self) -> dict:
        return {"outputs": [o.to_dict() for o in self.outputs], "metrics": pooled(self.metrics)}


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
    """A loaded artifact: tokenizer + engine (weights and compiled graphs), or, for a tensor-parallel CPU artifact,
    the rank group whose processes hold the shards."""

    def __init__(self, root: Path, manifest: Manifest, engine: Engine | None, tokenizer, group=None):
        self.root, self.manifest, self.engine, self.tokenizer = root, manifest, engine, tokenizer
        self.spec = engine.spec if engine is not None else None  # SpecEngine when compiled with --draft-model
        self.group = group  # runtime.rank_group.RankGroup for a tp > 1 CPU artifact, else None
        self.eos_ids = _eos_ids(manifest, tokenizer, root)

    @classmethod
    def load(cls, artifact_dir: str | Path, verify_files: bool = True,
             expect_checkpoint: str | Path | None = None) -> CompiledModel:
        """Load an artifact; with `expect_checkpoint`, also require that it was compiled from that checkpoint."""
        from neuron_infer.checkpoint import load_tokenizer

        root = Path(artifact_dir)
        manifest = read_manifest(root, verify_files=verify_files)
        if expect_checkpoint is not None:
            check_checkpoint(manifest, root, Path(expect_checkpoint))
        tokenizer = load_tokenizer(root / "tokenizer")
        if manifest.build.tp_degree != 1 and manifest.backend != "neuron":  # shards live in rank processes
            from neuron_infer.runtime.rank_group import RankGroup

            return cls(root, manifest, None, tokenizer, RankGroup(root, manifest))
        return cls(root, manifest, load_rank(root, 0, manifest), tokenizer)

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
                     on_tokens: Callable[[list[list[int]]], None] | None = None,
                     collect_logits: bool = False) -> GenerationOutput:
        """Generate from token ids. `collect_logits` (tensor-parallel rank groups): keep each step's logits in
        `self.group.last_run["logits"]` (tests compare them against tp = 1). Under torchrun, ranks other than 0
        return an empty GenerationOutput (rank 0 holds the results)."""
        if max_new_tokens < 1:
            raise NeuronInferError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if self.group is not None:
            got = self.group.generate_ids(prompts, max_new_tokens, sampling, self.eos_ids, ignore_eos, on_tokens,
                                          collect_logits)
            return GenerationOutput([], []) if got is None else GenerationOutput([self._text(r) for r in got[0]],
                                                                                 got[1])
        res, m = generate_ids(self.engine, prompts, max_new_tokens, sampling, self.eos_ids, ignore_eos, on_tokens)
        return GenerationOutput([self._text(r) for r in res], [m])

    def _text(self, r: SequenceResult) -> TextOutput:
        return TextOutput(r.token_ids, self.tokenizer.decode(r.token_ids, skip_special_tokens=True), r.finish_reason)
