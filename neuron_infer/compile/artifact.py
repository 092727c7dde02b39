"""The artifact directory: layout, manifest, atomic writes, verification.

    ARTIFACTS/
      manifest.json            written last; its presence marks a complete compile
      weights/rank{r}.safetensors   this rank's (sharded, quantized, tiled) weights, stored once
      graphs/<graph>/...       one compiled graph per (sub-model, bucket), backend-specific files
      tokenizer/               tokenizer files copied from the checkpoint

A compile writes into a temporary sibling directory and renames it into place, so a killed compile never leaves a
directory that loads. Loading checks the format version, the package versions the graphs depend on and the sha256
of every file, and names the differing field or file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.typed import parse_dataclass, read_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def package_versions() -> dict[str, str]:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from neuron_infer import __version__  # noqa: PLC0415

    return {"neuron_infer": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    format_version: int
    versions: dict[str, str]
    backend: str
    model: ModelConfig
    build: BuildConfig
    checkpoint_fingerprint: str
    graphs: dict[str, dict[str, Any]]  # graph name -> backend metadata (files, T, S, compile seconds)
    files: dict[str, str]  # relative path -> sha256
    extra: dict[str, Any] = field(default_factory=dict)  # feature records (tp plan, quant report, speculation)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "versions": self.versions,
            "backend": self.backend,
            "model": self.model.to_dict(),
            "build": self.build.to_dict(),
            "checkpoint_fingerprint": self.checkpoint_fingerprint,
            "graphs": self.graphs,
            "files": self.files,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Manifest":
        """Every field type-checked (neuron_infer.typed); a problem raises ArtifactError naming the field."""
        version = d.get("format_version") if isinstance(d, dict) else FORMAT_VERSION
        if version != FORMAT_VERSION:  # checked first: another format may have other fields
            raise ArtifactError(
                f"{where}: manifest format_version={version!r} but this neuron-infer reads "
                f"{FORMAT_VERSION}; recompile the model with this version (neuron-infer compile ...)"
            )
        try:
            return parse_dataclass(cls, d, where)
        except ConfigError as e:
            raise ArtifactError(f"{e}; the manifest is damaged or was written by another version: recompile "
                                "the model") from e


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by POSIX relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = sha256_file(p)
    return out


@contextmanager
def atomic_directory(final: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success rename it to `final`, on error delete it."""
    final = Path(final)
    if final.exists() and any(final.iterdir()) and not overwrite:
        raise ArtifactError(f"{final} already exists and is not empty; choose another -o directory or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write manifest.json last, through a temporary file and an atomic rename."""
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    tmp.replace(root / MANIFEST)


def read_manifest(root: Path, verify_files: bool = True) -> Manifest:
    """Read and check an artifact directory; every problem raises ArtifactError naming the field or file."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        state = "is a file, not an artifact directory" if root.exists() else "does not exist"
        raise ArtifactError(f"artifact directory {root} {state}; give the -o directory of an earlier "
                            f"`neuron-infer compile MODEL_DIR -o DIR`")
    if not path.is_file():
        hint = " (it looks like an interrupted compile)"
        raise ArtifactError(f"{path} not found{hint}: {root} is not a complete neuron-infer artifact; run "
                            f"`neuron-infer compile MODEL_DIR -o {root}` first")
    manifest = Manifest.from_dict(read_json(path, "recompile the model", ArtifactError), str(path))
    _check_versions(manifest, path)
    if verify_files:
        _check_files(root, manifest)
    return manifest


def _check_versions(m: Manifest, where: Path) -> None:
    current = package_versions()
    for pkg in ("neuron_infer", "torch"):  # compiled graphs are only valid for the exact versions that made them
        if m.versions.get(pkg) != current[pkg]:
            raise ArtifactError(
                f"{where}: versions.{pkg}={m.versions.get(pkg)!r} but this environment has {current[pkg]!r}; "
                "compiled graphs are tied to the versions that built them — recompile the model here"
            )


def _check_files(root: Path, m: Manifest) -> None:
    for rel, digest in m.files.items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(f"{p} is missing from the artifact; recompile the model")
        if sha256_file(p) != digest:
            raise ArtifactError(f"{p} is corrupted (sha256 differs from the manifest); recompile the model")
