"""Build presets (`configs/*.json`) and the cached compile of the embedded default model.

A preset file is `{"description": str, "model": str, "build": {BuildConfig fields}}`; `model` says what the preset
is for: "default" (the embedded SmolLM2), a planner preset name (e.g. "llama-3.1-405b"), a checkpoint path, or
prose. Command-line flags override the preset's build fields. Without --config, a user's checkpoint gets the
model-independent CHECKPOINT_PRESET and the embedded default model gets EMBEDDED_PRESET.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from neuron_infer.artifact.manifest import package_versions, read_manifest
from neuron_infer.config import BuildConfig
from neuron_infer.embedded import cache_dir, default_model_dir
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.output_dir import one_at_a_time
from neuron_infer.typed import Field, parse_fields, read_json, show

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CHECKPOINT_PRESET = "default"  # any user checkpoint: model-independent
EMBEDDED_PRESET = "smollm2-cpu"  # the embedded default model (its cached compiles are keyed by this build)
_PRESET_FIELDS = {"description": Field(str, ""), "model": Field(str, "default"), "build": Field(dict[str, Any], {})}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: str
    build: BuildConfig


def preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    known = sorted(x.stem for x in CONFIG_DIR.glob("*.json")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"--config {name_or_path!r}: no such file or preset; presets are {known}")


def load_preset(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> Preset:
    """Read a preset and apply build-field overrides (None values are ignored)."""
    path = preset_path(name_or_path)
    data = read_json(path, "fix the preset file")
    v = parse_fields(data, _PRESET_FIELDS, str(path))
    unknown = set(data) - set(_PRESET_FIELDS)
    if unknown:
        raise ConfigError(f"{path}: unknown preset key(s) {sorted(unknown)}; allowed: description, model, build")
    flags = any(x is not None for x in (overrides or {}).values())  # a bad value may be the user's flag
    build = merge_build(v["build"], overrides or {}, where=f"{path}: build{' with the flags given' * flags}")
    return Preset(path.stem, v["description"], v["model"], build)


def merge_build(base: Mapping[str, Any], overrides: Mapping[str, Any], where: str = "build config") -> BuildConfig:
    """BuildConfig from a base dict with top-level and `quant.*` / `speculation.*` overrides (None = unset).

    A limit given without its buckets (`max_context_length` without `context_buckets`, `max_length` without
    `tokengen_buckets`) replaces a base bucket list that no longer ends at the limit by the automatic one (powers
    of two up to the limit), so `--max-context-length 128` alone works with any preset. A limit given alone also
    moves the other one when the two would leave no room to generate: `--max-length 256` lowers a longer prompt
    limit to 128, `--max-context-length 2048` raises a shorter total to 4096.
    """
    merged: dict[str, Any] = json.loads(json.dumps(dict(base)))  # deep copy
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        group, _, name = key.rpartition(".")
        target = merged
        if group:
            if merged.get(group) is None:
                merged[group] = {}
            if not isinstance(merged[group], dict):
                raise ConfigError(f"{where}: {group} must be a JSON object {{...}}, not {show(merged[group])}")
            target = merged[group]
        target[name] = value
    moved = _keep_room_to_generate(merged, given)
    for limit, buckets in (("max_context_length", "context_buckets"), ("max_length", "tokengen_buckets")):
        old = merged.get(buckets)
        if (limit in given or limit in moved) and buckets not in given and isinstance(old, list) and old \
                and old[-1] != merged[limit]:
            merged[buckets] = None
    return BuildConfig.from_dict(merged, where)


def _keep_room_to_generate(merged: dict[str, Any], given: Mapping[str, Any]) -> set[str]:
    """With only one of the two limits given, move the other so a longest prompt still leaves room to generate
    (the prompt limit at most half the total, as in the presets); returns the names of the limits moved."""
    ctx, total = merged.get("max_context_length"), merged.get("max_length")
    if not (isinstance(ctx, int) and isinstance(total, int)) or isinstance(ctx, bool) or isinstance(total, bool):
        return set()  # wrong types: BuildConfig.from_dict names them
    if "max_length" in given and "max_context_length" not in given and ctx >= total:
        merged["max_context_length"] = max(1, total // 2)
        return {"max_context_length"}
    if "max_context_length" in given and "max_length" not in given and total <= ctx:
        merged["max_length"] = 2 * ctx
        return {"max_length"}
    return set()


def fit_to_model(build: BuildConfig, max_position_embeddings: int, keep_context: bool = False) -> BuildConfig:
    """`build` with its limits lowered to a model's max_position_embeddings when that is shorter (the prompt limit
    to at most half of it, unless `keep_context`: the user chose it) and buckets derived from the new limits;
    unchanged when the model is long enough. Applied to the model-independent default's limits, never to limits
    the user chose."""
    if build.max_length <= max_position_embeddings:
        return build
    limits = {"max_length": max_position_embeddings}
    if not keep_context:
        limits["max_context_length"] = min(build.max_context_length, max(1, max_position_embeddings // 2))
    elif build.max_context_length >= max_position_embeddings:
        raise ConfigError(f"--max-context-length {build.max_context_length} leaves no room to generate within the "
                          f"model's max_position_embeddings={max_position_embeddings}; lower --max-context-length")
    return merge_build(build.to_dict(), limits)


def all_presets() -> list[Preset]:
    return [load_preset(str(p)) for p in sorted(CONFIG_DIR.glob("*.json"))]


def default_artifact_dir(build: BuildConfig, say: Callable[[str], None]) -> Path:
    """Compile (once) or reuse the cached compile of the embedded default model for `build`."""
    from neuron_infer.checkpoint import checkpoint_fingerprint
    from neuron_infer.compile.builder import compile_model

    model_dir = default_model_dir(log=say)
    fp = checkpoint_fingerprint(model_dir)
    key = json.dumps({"build": build.to_dict(), "versions": package_versions(), "fp": fp}, sort_keys=True)
    out = cache_dir() / "artifacts" / f"smollm2-135m-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with one_at_a_time(out):  # a concurrent run waits for this compile, then reuses it
        try:
            if read_manifest(out, verify_files=False).checkpoint_fingerprint == fp:
                return out
        except ArtifactError:
            pass
        say(f"compiling the embedded default model into {out} (once; later runs reuse it)")
        compile_model(model_dir, out, build, overwrite=True, say=say)
    return out
