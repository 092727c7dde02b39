"""The artifact directory: layout, manifest, atomic writes, verification.

    ARTIFACTS/
      manifest.json            written last; its presence marks a complete compile
      weights/rank{r}.safetensors   this rank's (sharded, quantized, tiled) weights, stored once
      graphs/<graph>/...       one compiled graph per (sub-model, bucket), backend-specific files
      tokenizer/               tokenizer files copied from the checkpoint

A compile writes into a temporary sibling directory and renames it into place, so a killed compile never leaves a
directory that loads; neuron_infer.output_dir says what `--overwrite` may replace and keeps one writer per output.
Loading checks the format version, the manifest's own checksum (`manifest_sha256`, over its canonical JSON), the
package versions the graphs depend on, that every file in the directory is a regular file (no symbolic link, no
entry outside the directory) listed in the manifest and that each matches its sha256, and names the differing field
or file. The tokenizer files are verified before the tokenizer (and its chat template) is read.

The checksums catch damage and edits, not a rewrite that recomputes them. The trust anchor outside the artifact is
its digest, the sha256 of manifest.json as stored (`neuron-infer info` prints it): `read_manifest(root,
expect_digest=...)` refuses any other manifest before it is parsed, and that manifest pins every listed file.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_infer import __version__
from neuron_infer.artifact.records import ManifestExtra
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.output_dir import PARTIAL_MARKER, atomic_output
from neuron_infer.typed import json_from_bytes, parse_dataclass, parse_json, show

FORMAT_VERSION = 4  # 2: block KV cache (build.kv_block_size); 3: manifest_sha256; 4: prefill class logit rows [1, R]
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"  # the manifest's checksum of its own content (every other key)
TOKENIZER_DIR = "tokenizer"
LAYOUT_DIRS = ("graphs/", "weights/", "tokenizer/")  # directories every artifact has (graphs/ may stay empty)


def package_versions() -> dict[str, str]:
    import torch
    import transformers


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
    extra: ManifestExtra  # feature records (quantization report, tp plan, speculation, compile time)

    @property
    def neuron_lnc(self) -> int | None:
        """The logical-NeuronCore degree the neuron graphs were compiled for (recorded per graph), or None."""
        degrees = {g["lnc"] for g in self.graphs.values() if "lnc" in g}
        if len(degrees) > 1:
            raise ArtifactError(f"the graphs of this artifact disagree on their LNC ({sorted(degrees)}); recompile")
        return degrees.pop() if degrees else None

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
            "extra": self.extra.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Manifest:
        """Every field type-checked (neuron_infer.typed); a problem raises ArtifactError naming the field."""
        version = d.get("format_version") if isinstance(d, dict) else FORMAT_VERSION
        if version != FORMAT_VERSION:  # checked first: another format may have other fields
            raise ArtifactError(
                f"{where}: manifest format_version={version!r} but this neuron-infer reads "
                f"{FORMAT_VERSION}; recompile the model with this version (neuron-infer compile ...)"
            )
        try:
            if isinstance(d, dict) and isinstance(d.get("build"), dict) and "tokengen_batch_buckets" not in d["build"]:
                build = d["build"]  # written before batch buckets existed: the full-batch graph only
                d = {**d, "build": {**build, "tokengen_batch_buckets": [build.get("batch_size", 1)]}}
            return parse_dataclass(cls, d, where)
        except ConfigError as e:
            raise ArtifactError(f"{e}; the manifest is damaged or was written by another version: recompile "
                                "the model") from e


def hash_tree_names(root: Path) -> list[str]:
    """POSIX relative paths of every file under root except the manifest (and the marker of a directory being
    written, removed before it becomes the artifact)."""
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, PARTIAL_MARKER)]


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by POSIX relative path."""
    return {rel: sha256_file(root / rel) for rel in hash_tree_names(root)}


def atomic_directory(final: Path, overwrite: bool, sources: Iterable[str | Path] = ()):
    """Context manager yielding a temporary directory that becomes `final` on success (neuron_infer.output_dir:
    never a source directory, --overwrite replaces only a previous artifact, one writer at a time)."""
    return atomic_output(final, overwrite=overwrite, owned=artifact_files, what="compiled artifact", sources=sources)


def artifact_files(root: Path) -> set[str] | None:
    """The files a previous artifact in `root` owns (its manifest and the files it lists), or None if not one."""
    try:
        data = parse_json((Path(root) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "format_version" not in data or not isinstance(data.get("files"), dict):
        return None
    try:
        for rel in data["files"]:
            _check_entry(rel, MANIFEST)
    except ArtifactError:
        return None  # entries outside the directory: not an artifact we wrote
    return {MANIFEST, *data["files"], *LAYOUT_DIRS}


def manifest_checksum(d: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace), its own checksum key left out."""
    body = {k: v for k, v in d.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(d: Any) -> Any:
    """The manifest dict with its checksum set (any other JSON value unchanged)."""
    return {**d, CHECKSUM: manifest_checksum(d)} if isinstance(d, dict) else d


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write manifest.json last (with its checksum), through a temporary file and an atomic rename."""
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(seal(manifest.to_dict()), indent=2, sort_keys=True))
    tmp.replace(root / MANIFEST)


def parse_manifest(data: Any, where: str) -> Manifest:
    """A manifest from its JSON value: format version first, then its checksum, then every field's type."""
    if isinstance(data, dict) and data.get("format_version") == FORMAT_VERSION:
        if data.get(CHECKSUM) != manifest_checksum(data):
            what = "has no manifest_sha256" if CHECKSUM not in data else "does not match its manifest_sha256"
            raise ArtifactError(f"{where} {what}: it was edited or damaged after the compile, and nothing in it is "
                                "trusted; recompile the model")
        data = {k: v for k, v in data.items() if k != CHECKSUM}
    manifest = Manifest.from_dict(data, where)
    for rel in manifest.files:
        _check_entry(rel, where)
    if manifest.build.max_length > manifest.model.max_position_embeddings:  # the compile refuses such a build
        raise ArtifactError(f"{where}: build.max_length={manifest.build.max_length} exceeds the model's "
                            f"model.max_position_embeddings={manifest.model.max_position_embeddings}; the manifest is "
                            "damaged or was edited: recompile the model")
    return manifest


def _check_entry(rel: str, where: str) -> None:
    """A manifest `files` key is a plain relative POSIX path inside the artifact (no '..', '.', '' or leading /)."""
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts) or rel == MANIFEST:
        raise ArtifactError(f"{where}: files entry {rel!r} is not a path inside the artifact directory; the manifest "
                            "is damaged: recompile the model")


def manifest_digest(raw: bytes) -> str:
    """An artifact's digest: the sha256 of its manifest.json as stored (what `sha256sum manifest.json` prints)."""
    return hashlib.sha256(raw).hexdigest()


def check_digest(value: Any, name: str = "expect_digest") -> str:
    """An expected digest as given by the user: 64 hex digits (an optional `sha256:` prefix) -> lowercase hex."""
    text = value.strip().lower().removeprefix("sha256:") if isinstance(value, str) else None
    if text is None or len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ConfigError(f"{name}{' ' if name.startswith('--') else '='}{show(value)} is not a sha256 digest: give the 64 hex digits `neuron-infer info "
                          "ARTIFACTS` prints (or `sha256sum ARTIFACTS/manifest.json`)")
    return text


def read_manifest_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e.strerror or e}; recompile the model") from e


def read_manifest(root: Path, verify_files: bool = True, expect_digest: str | None = None) -> Manifest:
    """Read and check an artifact directory; every problem raises ArtifactError naming the field or file.
    `expect_digest` (check_digest's form): the manifest's digest must be this one, checked before it is parsed."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        state = "is a file, not an artifact directory" if root.exists() else "does not exist"
        raise ArtifactError(f"artifact directory {root} {state}; give the -o directory of an earlier "
                            f"`neuron-infer compile MODEL_DIR -o DIR`")
    if not path.is_file():
        if (root / "config.json").is_file():  # a checkpoint: compile it into a new directory, never into itself
            named = root if root.name not in ("", ".", "..") else root.resolve()  # "." has no name to extend
            out = named.parent / f"{named.name}-compiled"
            raise ArtifactError(f"{root} is a model checkpoint, not a compiled artifact: run `neuron-infer compile "
                                f"{root} -o {out}`, then `neuron-infer generate {out}`")
        hint = " (it looks like an interrupted compile)" if root.is_dir() else ""
        raise ArtifactError(f"{path} not found{hint}: {root} is not a complete neuron-infer artifact; run "
                            f"`neuron-infer compile MODEL_DIR -o {root}` first")
    raw = read_manifest_bytes(path)
    if expect_digest is not None and manifest_digest(raw) != expect_digest:
        raise ArtifactError(f"{path} has the digest {manifest_digest(raw)}, not the expected {expect_digest}: this "
                            "is not the artifact that digest pins (rebuilt, edited or replaced); nothing in it was "
                            "used")
    manifest = parse_manifest(json_from_bytes(raw, path, "recompile the model", ArtifactError), str(path))
    _check_versions(manifest, path)
    if verify_files:
        check_files(root, manifest)
    return manifest


def _check_versions(m: Manifest, where: Path) -> None:
    current = package_versions()
    for pkg in ("neuron_infer", "torch"):  # compiled graphs are only valid for the exact versions that made them
        if m.versions.get(pkg) != current[pkg]:
            raise ArtifactError(
                f"{where}: versions.{pkg}={m.versions.get(pkg)!r} but this environment has {current[pkg]!r}; "
                "compiled graphs are tied to the versions that built them — recompile the model here"
            )


def check_files(root: Path, m: Manifest, under: str | None = None) -> None:
    """Every file under root (or under root/`under`) is a regular file listed in the manifest whose sha256 matches,
    and no entry is a symbolic link or special file: a load reads no unverified file, and nothing outside the
    artifact. `under`: one subdirectory, e.g. TOKENIZER_DIR, verified before its files are read."""
    for rel in _listed(Path(root), m, under):
        if _sha256_nofollow(Path(root) / rel) != m.files[rel]:
            raise _corrupted(Path(root) / rel)


def read_verified(root: Path, m: Manifest, under: str) -> dict[str, bytes]:
    """The bytes of every file under root/`under` (the same refusals as `check_files`), each read once and
    hashed: the bytes returned are the bytes verified, so a file swapped after the check is never used."""
    return {rel: _read_checked(Path(root), m, rel) for rel in _listed(Path(root), m, under)}


def _read_checked(root: Path, m: Manifest, rel: str) -> bytes:
    try:
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW)  # a link put in its place is refused (ELOOP)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ArtifactError(f"cannot read {root / rel}: {e.strerror or e}; recompile the model") from e
    if hashlib.sha256(data).hexdigest() != m.files[rel]:
        raise _corrupted(root / rel)
    return data


def _corrupted(path: Path) -> ArtifactError:
    return ArtifactError(f"{path} is corrupted (sha256 differs from the manifest); recompile the model")


def _listed(root: Path, m: Manifest, under: str | None) -> list[str]:
    """The manifest's files under root/`under`, sorted, after checking that each is present and that the directory
    holds no other entry (unlisted file, link, special file)."""
    top = root / under if under else root
    scope = f"{under}/" if under else ""
    present = set(_regular_files(root, top))
    listed = sorted(rel for rel in m.files if rel.startswith(scope))
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise ArtifactError(f"{root / unlisted[0]} is not listed in the manifest's files, so it cannot be verified "
                            "(an artifact is loaded only when every file is listed); recompile the model")
    for rel in listed:
        if rel not in present:
            raise ArtifactError(f"{root / rel} is missing from the artifact; recompile the model")
    return listed


def _regular_files(root: Path, top: Path) -> list[str]:
    """Relative paths of the files under `top` (the manifest excepted); a symbolic link (to a file or directory)
    or a special file anywhere below `root` is refused, since it could point outside the artifact (`root` itself
    may be one: the user's own name for the artifact)."""
    if not os.path.lexists(top):
        return []
    found = []
    for path in ([top] if top != root else []) + _walk(top):  # the artifact directory itself may be a link
        st = path.lstat()
        rel = path.relative_to(root).as_posix()
        if stat.S_ISLNK(st.st_mode):
            raise ArtifactError(f"{path} is a symbolic link; an artifact holds only its own regular files (a link "
                                "can point outside it), so it is not loaded: recompile the model")
        if stat.S_ISREG(st.st_mode):
            if rel != MANIFEST:
                found.append(rel)
        elif not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"{path} is not a regular file; recompile the model")
    return found


def _walk(top: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):  # a linked directory is listed, not entered
        out += [Path(dirpath) / n for n in sorted(dirnames + filenames)]
    return out


def _sha256_nofollow(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_verified_tokenizer(root: Path, manifest: Manifest):
    """The artifact's tokenizer (its chat template included), built from the verified bytes of its files: each is
    read once, hashed, and those bytes are what the tokenizer loads (from a private copy, removed at once)."""
    from neuron_infer.checkpoint import check_vocab, load_tokenizer

    files = read_verified(root, manifest, TOKENIZER_DIR)
    shown = Path(root) / TOKENIZER_DIR
    fix = "recompile the model (its tokenizer files are damaged)"
    try:
        with tempfile.TemporaryDirectory(prefix="neuron-infer-tokenizer-") as private:
            for rel, data in files.items():
                (Path(private) / rel.removeprefix(f"{TOKENIZER_DIR}/")).write_bytes(data)
            tok = load_tokenizer(private, fix, shown=shown)
    except OSError as e:
        raise ArtifactError(f"cannot copy the verified tokenizer files of {root} into the temporary directory "
                            f"{tempfile.gettempdir()}: {e.strerror or e}; free space there, or point TMPDIR at "
                            "another directory") from e
    check_vocab(tok, manifest.model.vocab_size, shown, "the manifest's model.vocab_size", fix, ArtifactError)
    return tok


def verified_generation_config(root: Path, manifest: Manifest) -> bytes | None:
    """The verified bytes of the artifact's tokenizer/generation_config.json (None: it has none)."""
    rel = f"{TOKENIZER_DIR}/generation_config.json"
    if rel not in manifest.files:
        if os.path.lexists(Path(root) / rel):
            raise ArtifactError(f"{Path(root) / rel} is not listed in the manifest's files, so it cannot be "
                                "verified; recompile the model")
        return None
    return _read_checked(Path(root), manifest, rel)


def check_checkpoint(manifest: Manifest, root: Path, model_dir: Path) -> None:
    from neuron_infer.checkpoint import checkpoint_fingerprint

    found = checkpoint_fingerprint(model_dir)
    if found != manifest.checkpoint_fingerprint:
        raise ArtifactError(
            f"{root / 'manifest.json'}: checkpoint_fingerprint {manifest.checkpoint_fingerprint[:12]}... does not match "
            f"{model_dir} ({found[:12]}...): the artifact was compiled from another checkpoint; recompile it"
        )
