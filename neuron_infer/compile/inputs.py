"""The inputs of a compile: checks that need the model, the directories it must never replace, the tokenizer
files it copies."""
from __future__ import annotations

import shutil
from pathlib import Path

import psutil

from neuron_infer.compile.spec_builder import check_speculation
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import CheckpointError, ConfigError
from neuron_infer.parallel.plan import ShardPlan

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")

def check_build_against_model(cfg: ModelConfig, build: BuildConfig) -> None:
    """Combinations that only fail once the model is known."""
    if build.max_length > cfg.max_position_embeddings:
        raise ConfigError(
            f"--max-length {build.max_length} exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}; lower --max-length"
        )
    check_kv_cache_fits(cfg, build)
    if build.target == "cpu" and build.tp_degree != 1:
        ShardPlan.build(cfg, build.tp_degree)
    if build.speculation is not None:
        check_speculation(cfg, build)


def check_kv_cache_fits(cfg: ModelConfig, build: BuildConfig) -> None:
    """The default KV cache (batch_size sequences of max_length, K and V, all ranks together) must fit the machine's
    memory: a sizing error names the fix instead of an allocation failure at load."""
    elem = 4 if build.dtype == "fp32" else 1 if build.quant.kv_cache_dtype == "fp8" else 2
    need = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * build.batch_size * build.max_length
    have = psutil.virtual_memory().total
    if need > have:
        raise ConfigError(f"--batch-size {build.batch_size} x --max-length {build.max_length} needs a KV cache of "
                          f"{need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB of memory; lower "
                          "--batch-size or --max-length")


def source_dirs(model_dir: Path, build: BuildConfig) -> list[Path]:
    """The input directories of a compile (which its output must never replace)."""
    draft = build.speculation.draft_model if build.speculation is not None else None
    return [Path(model_dir)] + ([Path(draft)] if draft not in (None, "self", "ngram") else [])


def copy_tokenizer(model_dir: Path, dst: Path) -> None:
    """Copy the checkpoint's tokenizer files into `dst` (the artifact's tokenizer/, which is checked after the copy:
    a file changed in the checkpoint during the compile never reaches the artifact unchecked)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            try:
                shutil.copy2(src, dst / name)  # refuses a FIFO or device swapped in after is_file (SpecialFileError)
            except shutil.SpecialFileError as e:
                raise CheckpointError(f"cannot copy the tokenizer file {src}: {e}; give a regular file") from e
