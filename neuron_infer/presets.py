"""Build presets (`configs/*.json`) and the cached compile of the embedded default model.

A preset file is `{"description": str, "model": str, "build": {BuildConfig fields}}`; `model` is "default" (the
embedded SmolLM2), a planner preset name (e.g. "llama-3.1-405b") or a checkpoint path. Command-line flags override
the preset's build fields.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from neuron_infer.config import BuildConfig
from neuron_infer.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "smollm2-cpu"


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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from e
    unknown = set(data) - {"description", "model", "build"}
    if unknown:
        raise ConfigError(f"{path}: unknown preset key(s) {sorted(unknown)}; allowed: description, model, build")
    build = merge_build(data.get("build", {}), overrides or {})
    return Preset(path.stem, data.get("description", ""), data.get("model", "default"), build)


def merge_build(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> BuildConfig:
    """BuildConfig from a base dict with top-level and `quant.*` / `speculation.*` overrides (None = unset)."""
    merged: dict[str, Any] = json.loads(json.dumps(dict(base)))  # deep copy
    for key, value in overrides.items():
        if value is None:
            continue
        if "." in key:
            group, field = key.split(".", 1)
            merged.setdefault(group, {})
            if merged[group] is None:
                merged[group] = {}
            merged[group][field] = value
        else:
            merged[key] = value
    return BuildConfig.from_dict(merged)


def all_presets() -> list[Preset]:
    return [load_preset(str(p)) for p in sorted(CONFIG_DIR.glob("*.json"))]


def default_artifact_dir(build: BuildConfig, say: Callable[[str], None]) -> Path:
    """Compile (once) or reuse the cached compile of the embedded default model for `build`."""
    from neuron_infer.checkpoint import checkpoint_fingerprint  # noqa: PLC0415
    from neuron_infer.compile.artifact import package_versions, read_manifest  # noqa: PLC0415
    from neuron_infer.compile.builder import compile_model  # noqa: PLC0415
    from neuron_infer.embedded import cache_dir, default_model_dir  # noqa: PLC0415
    from neuron_infer.errors import ArtifactError  # noqa: PLC0415
    from neuron_infer.output_dir import one_at_a_time  # noqa: PLC0415

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
