"""The inputs of a compile: checks that need the model, the directories it must never replace, the tokenizer
files it copies."""
from __future__ import annotations

import shutil
from pathlib import Path

import psutil

from neuron_infer.artifact.plan import kv_cache_shape, run_bytes
from neuron_infer.compile.graph_workers import graph_compile_bytes
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
    check_memory_fits(cfg, build)
    if build.target == "cpu" and build.tp_degree != 1:
        ShardPlan.build(cfg, build.tp_degree)
    if build.speculation is not None:
        check_speculation(cfg, build)


def check_memory_fits(cfg: ModelConfig, build: BuildConfig) -> None:
    """Sizing errors before any work, each naming the bound and the fix (instead of an allocation failure or the
    kernel's out-of-memory kill): the built model's batch (run_bytes: the KV cache of batch_size sequences of
    max_length, every rank's together, and the logits of a full batch; the load checks the same) must fit this
    machine's memory, and a graph compile's example KV cache (graph_compile_bytes: the rank's cache twice) the
    memory available now."""
    flags = f"--batch-size {build.batch_size} x --max-length {build.max_length}"
    cache = kv_cache_shape(cfg, cfg.num_kv_heads, build)
    need, have = run_bytes(cache, build, cfg.vocab_size), psutil.virtual_memory().total
    if need > have:
        raise ConfigError(f"{flags} needs {_gib(need)} GiB to run (a KV cache of {_gib(cache.nbytes())} GiB and the "
                          f"logits of a full batch), more than this machine's {_gib(have)} GiB of memory; lower "
                          "--batch-size or --max-length")
    rank = kv_cache_shape(cfg, -(-cfg.num_kv_heads // build.tp_degree), build)  # at least a rank's heads
    need, free = graph_compile_bytes(rank.nbytes(), base=0), psutil.virtual_memory().available
    if need > free:
        raise ConfigError(f"{flags}: compiling a graph holds its example KV cache ({_gib(rank.nbytes())} GiB) twice, "
                          f"at least {_gib(need)} GiB, more than the {_gib(free)} GiB of memory available on this "
                          "machine now; lower --batch-size or --max-length, or free memory")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


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
