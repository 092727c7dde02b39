"""A tiny compiled artifact for CLI and API tests: eager graphs (these tests exercise the front end, not the graph
compiler), fp32, buckets large enough for chat templates."""
from __future__ import annotations

from pathlib import Path

from neuron_infer.api import compile_model
from neuron_infer.config import BuildConfig

CLI_BUILD = BuildConfig(dtype="fp32", max_context_length=256, max_length=320, context_buckets=(64, 256),
                        tokengen_buckets=(320,))


def compile_tiny(model_dir: Path, out: Path, build: BuildConfig = CLI_BUILD) -> Path:
    compile_model(model_dir, out, build, backend="cpu-eager", say=lambda _m: None)
    return out


def relist(root: Path) -> None:
    """Rewrite an artifact's manifest (files and checksum) after a test edited its files, as a compile of the edited
    inputs would have written it: the load then verifies the edited files instead of refusing them."""
    import json

    from neuron_infer.artifact.manifest import MANIFEST, hash_tree, seal

    m = json.loads((root / MANIFEST).read_text())
    m["files"] = hash_tree(root)
    (root / MANIFEST).write_text(json.dumps(seal(m)))


def rewrite_weights(root: Path, edit) -> Path:
    """Edit an artifact's rank-0 weights in place with edit(state dict) and rewrite its manifest to match (a
    consistent, hostile edit that the hashes then match) -> root."""
    from safetensors.torch import load_file, save_file

    path = root / "weights" / "rank0.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)
    relist(root)
    return root
