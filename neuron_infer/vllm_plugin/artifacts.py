"""Which artifact serves a vLLM engine: given explicitly, or compiled once from vLLM's arguments into a cache.

    additional_config={"neuron_infer_artifacts": DIR}          serve DIR (compiled earlier with `neuron-infer compile`)
    additional_config={"neuron_infer_build": {...}}            BuildConfig fields over the defaults derived below
    additional_config={"neuron_infer_backend": "cpu-eager"}    graph backend (default: the build target's)
    additional_config={"neuron_infer_cache_dir": DIR}          cache root (default $NEURON_INFER_CACHE or
                                                               ~/.cache/neuron-infer, subdirectory vllm/)

Defaults from vLLM: dtype (float32 -> fp32, bfloat16 -> bf16), batch_size = --max-num-seqs, max_length =
max_context_length = --max-model-len, tp_degree = --tensor-parallel-size. The cache key hashes the checkpoint
fingerprint, the build, the backend and the package versions, so a changed model or argument compiles anew and an
unchanged one loads in seconds. Concurrent engines compiling the same key wait on a file lock.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_infer.artifact.manifest import MANIFEST, package_versions, read_manifest
from neuron_infer.config import BuildConfig
from neuron_infer.errors import ConfigError
from neuron_infer.output_dir import one_at_a_time
from neuron_infer.runtime.options import RunOptions

KEYS = ("neuron_infer_artifacts", "neuron_infer_build", "neuron_infer_backend", "neuron_infer_cache_dir",
        "neuron_infer_kv_cache_gib", "neuron_infer_prefix_caching",
        "neuron_infer_speculation_gate")
_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class EngineArgs:
    """The vLLM settings an artifact depends on (plain values, extracted by the platform/worker)."""

    model: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    max_model_len: int
    max_num_seqs: int
    tensor_parallel_size: int = 1


def plugin_options(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Our keys of vLLM's `additional_config`; a misspelt `neuron_infer_*` key raises instead of being ignored."""
    extra = dict(additional_config or {})
    ours = {k: v for k, v in extra.items() if k.startswith("neuron_infer")}
    unknown = sorted(set(ours) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown additional_config key(s) {unknown}; the neuron-infer plugin reads {list(KEYS)}")
    return ours


def kv_cache_gib(options: Mapping[str, Any]) -> float | None:
    """`neuron_infer_kv_cache_gib`: KV-cache memory per rank in GiB (None: batch_size sequences of max_length)."""
    v = options.get("neuron_infer_kv_cache_gib")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"additional_config neuron_infer_kv_cache_gib={v!r} must be a positive number of GiB")
    return float(v)


def run_options(options: Mapping[str, Any]) -> RunOptions:
    """`neuron_infer_speculation_gate` (default true): with a draft model, take plain steps while speculative steps
    are measured not to pay (docs/speculation.md). Prefix caching and the prefill chunks are vLLM's to decide (its
    block manager drives the engine's cache, `prefix_caching`; SlotRunner turns the engine's own off)."""
    return RunOptions(speculation_gate=_flag(options, "speculation_gate", True))


def step_tokens(budget: int, vllm_defaults: Iterable[int], chunked_prefill: bool, max_num_seqs: int,
                build: BuildConfig) -> int:
    """vLLM's step budget for this build: left at one of vLLM's defaults (`vllm_defaults`) with chunked prefill on,
    the runtime's prefill chunk (`RunOptions.chunk_tokens`; at least max_num_seqs, which vLLM requires), so that
    each step encodes at most that many prompt tokens and vLLM reports the requests it admitted right after it;
    otherwise `budget` as given (the user's choice; without chunked prefill vLLM needs whole prompts)."""
    if not chunked_prefill or budget not in set(vllm_defaults):
        return budget
    return min(budget, max(RunOptions().chunk_tokens(build), max_num_seqs))


def prefix_caching(options: Mapping[str, Any]) -> bool | None:
    """`neuron_infer_prefix_caching`: the same as vLLM's --enable-prefix-caching / --no-enable-prefix-caching (None:
    vLLM's own setting)."""
    return _flag(options, "prefix_caching", None)


def _flag(options: Mapping[str, Any], key: str, default: bool | None) -> bool | None:
    v = options.get(f"neuron_infer_{key}", default)
    if v is not default and not isinstance(v, bool):
        raise ConfigError(f"additional_config neuron_infer_{key}={v!r} must be true or false")
    return v


def default_build(args: EngineArgs, overrides: Mapping[str, Any] | None = None) -> BuildConfig:
    """BuildConfig derived from vLLM's arguments, with `overrides` (BuildConfig fields) on top."""
    if args.dtype not in _DTYPES:
        raise ConfigError(
            f"vLLM dtype {args.dtype!r} is not supported by neuron-infer; pass --dtype bfloat16 or --dtype float32"
        )
    base = BuildConfig(dtype=_DTYPES[args.dtype], batch_size=args.max_num_seqs, max_length=args.max_model_len,
                       max_context_length=args.max_model_len, tp_degree=args.tensor_parallel_size).to_dict()
    return BuildConfig.from_dict({**base, **dict(overrides or {})})


def check_against_engine(build: BuildConfig, args: EngineArgs, where: str) -> None:
    """An artifact can serve the engine only if its static shapes cover vLLM's limits."""
    if args.max_model_len > build.max_length:
        raise ConfigError(
            f"{where}: vLLM max_model_len={args.max_model_len} exceeds the artifact's max_length={build.max_length}; "
            f"pass --max-model-len {build.max_length} (or smaller), or recompile with a larger max_length"
        )
    if args.max_num_seqs > build.batch_size:
        raise ConfigError(
            f"{where}: vLLM max_num_seqs={args.max_num_seqs} exceeds the artifact's batch_size={build.batch_size} "
            f"(one cache row per running request); pass --max-num-seqs {build.batch_size} (or smaller), or "
            "recompile with a larger batch_size"
        )
    if args.tensor_parallel_size != build.tp_degree:
        raise ConfigError(
            f"{where}: vLLM tensor_parallel_size={args.tensor_parallel_size} but the artifact has "
            f"tp_degree={build.tp_degree}; pass --tensor-parallel-size {build.tp_degree}"
        )


def single_worker(backend: str | None, build: BuildConfig) -> bool:
    """Whether vLLM runs one worker inside its engine-core process (its "uni" executor) instead of one worker
    process per rank ("mp").
    - One rank (tp 1, any target): yes. With "mp" the engine core waits for each step's reply by polling vLLM's
      shared-memory queue, which keeps part of a core busy for the whole step (46% of one core, sampled with top
      while a prompt was encoded on a 2-core machine), so vLLM's CPU default pins the worker to the cores left
      (one of two there). In one process nothing polls, and the engine's thread policy gives the forward every
      core the front end leaves free.
    - Neuron, tp > 1: yes, neuronx-distributed runs the whole group on the NeuronCores from one process (as
      vllm-neuron does).
    - CPU, tp > 1: no, each rank is its own process (one vLLM worker per rank, joined by vLLM's gloo group)."""
    return build.tp_degree == 1 or (backend or build.target) == "neuron"


def cache_root(options: Mapping[str, Any]) -> Path:
    if options.get("neuron_infer_cache_dir"):
        return Path(options["neuron_infer_cache_dir"])
    base = os.environ.get("NEURON_INFER_CACHE") or Path.home() / ".cache" / "neuron-infer"
    return Path(base) / "vllm"


def cache_key(fingerprint: str, build: BuildConfig, backend: str | None, versions: Mapping[str, str]) -> str:
    blob = json.dumps({"checkpoint": fingerprint, "build": build.to_dict(), "backend": backend,
                       "versions": dict(versions)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolve_model_dir(model: str) -> Path:
    """vLLM's --model as a local checkpoint directory (a path, or a Hugging Face id already in the local cache)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:
        raise ConfigError(
            f"--model {model!r} is neither a directory nor a downloaded Hugging Face model; the neuron-infer plugin "
            "compiles from a local checkpoint: download it (huggingface-cli download ...) and pass its directory"
        ) from e


def ensure_artifact(args: EngineArgs, options: Mapping[str, Any], say=print) -> Path:
    """The artifact directory for this engine: the explicit one, or the cached compile (compiling on a miss)."""
    from neuron_infer.checkpoint import checkpoint_fingerprint

    if options.get("neuron_infer_artifacts"):
        root = Path(options["neuron_infer_artifacts"])
        check_against_engine(read_manifest(root, verify_files=False).build, args, str(root))
        return root
    model_dir = resolve_model_dir(args.model)
    build = default_build(args, options.get("neuron_infer_build"))
    backend = options.get("neuron_infer_backend")
    key = cache_key(checkpoint_fingerprint(model_dir), build, backend, package_versions())
    root = cache_root(options) / f"{model_dir.name}-{key}"
    with one_at_a_time(root):  # a second engine waits for the first compile, then loads it
        if not (root / MANIFEST).is_file():
            from neuron_infer.compile.builder import compile_model

            say(f"neuron-infer: compiling {model_dir} into {root} (once; later starts load it)")
            compile_model(model_dir, root, build, backend=backend, overwrite=True, say=say)
    return root
