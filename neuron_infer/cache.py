"""What neuron-infer keeps in its cache (`$NEURON_INFER_CACHE`, else `~/.cache/neuron-infer`), and pruning it.

    <cache>/models/SmolLM2-135M-Instruct-<sha16>/     the converted default model (marker: neuron_infer_source.json)
    <cache>/artifacts/smollm2-135m-<hash16>/          cached compiles of it (marker: a manifest.json that parses)
    <cache>/graphs/<key32>/                           compiled graphs shared by every compile on this machine
                                                      (marker: neuron_infer_graph.json; backends/graph_cache.py)
    <cache>/kernels/<key32>.gemv.so                   the CPU backend's C kernels, one per ISA level and source
    <cache>/models/.tmp-SmolLM2-135M-Instruct-<sha16>-*   leftovers of interrupted conversions
    <cache>/artifacts/.smollm2-135m-<hash16>.partial-*    leftovers of interrupted compiles (also `.old-<pid>`)
    <cache>/graphs/.<key32>.partial-<pid>             a graph being stored, or left by an interrupted compile

An entry is ours only when its whole name has one of these exact shapes *and* it holds its marker file (models,
artifacts, graphs: as above; leftovers: neuron_infer.output_dir.PARTIAL_MARKER); everything else in the cache (e.g.
a virtualenv, a user's files) is listed as "other" and never deleted. Symbolic links are never followed or deleted.
A model, artifact or graph entry holding anything neuron-infer did not write there (a file its manifest or marker
does not list, a directory, a link) is `kept`: listed with what is in the way, and never pruned.

States: `current` (loadable by this installation), `stale` (built by other package versions or graph sources, or
converted from a GGUF file that is no longer the installed one) and `partial` (an interrupted build older than an
hour; a younger one may be a build in progress and is left alone). `prune` removes stale and partial entries;
`prune --all` also removes current ones (they are rebuilt on next use).
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from neuron_infer.artifact.manifest import artifact_files, package_versions
from neuron_infer.backends.graph_cache import KEY_RE, MARKER, PARTIAL_RE, current_versions
from neuron_infer.embedded import MODEL_NAME, SOURCE_FILE, file_sha256, find_gguf
from neuron_infer.errors import CheckpointError
from neuron_infer.output_dir import foreign_entries, is_marked
from neuron_infer.typed import parse_json

ARTIFACT_PREFIX = "smollm2-135m"  # neuron_infer.presets.default_artifact_dir names its compiles so
PARTIAL_AGE_S = 3600.0
_KERNEL_RE = re.compile(r"\A[0-9a-f]{32}\.gemv\.so\Z")
_MODEL_RE = re.compile(rf"^{re.escape(MODEL_NAME)}-([0-9a-f]{{16}})$")
_ARTIFACT_RE = re.compile(rf"^{re.escape(ARTIFACT_PREFIX)}-[0-9a-f]{{16}}$")
_MODEL_TMP_RE = re.compile(rf"^\.tmp-{re.escape(MODEL_NAME)}-[0-9a-f]{{16}}-[A-Za-z0-9_]+$")
_ARTIFACT_TMP_RE = re.compile(rf"^\.{re.escape(ARTIFACT_PREFIX)}-[0-9a-f]{{16}}\.(partial-[A-Za-z0-9_]+|old-\d+)$")


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    kind: str  # "model" | "artifact" | "graph" | "kernel" | "partial" | "other"
    state: str  # "current" | "stale" | "partial" | "in progress" | "other"
    size_bytes: int
    reason: str = ""

    def to_dict(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "state": self.state, "size_bytes": self.size_bytes,
                "reason": self.reason}


def tree_size(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _current_gguf_sha16() -> str | None:
    try:
        return file_sha256(find_gguf())[:16]
    except CheckpointError:
        return None


def _model_entry(p: Path, gguf16: str | None) -> CacheEntry | None:
    m = _MODEL_RE.fullmatch(p.name)
    try:
        source = parse_json((p / SOURCE_FILE).read_bytes()) if m else None
    except (OSError, ValueError):
        source = None
    if not isinstance(source, dict) or not str(source.get("gguf_sha256", "")).startswith(m.group(1)):
        return None
    if gguf16 == m.group(1):
        return CacheEntry(p, "model", "current", tree_size(p))
    why = "the GGUF package is not installed" if gguf16 is None else "converted from another GGUF file"
    return CacheEntry(p, "model", "stale", tree_size(p), why)


def _artifact_entry(p: Path, versions: dict[str, str]) -> CacheEntry | None:
    if not _ARTIFACT_RE.fullmatch(p.name):
        return None
    try:
        manifest = parse_json((p / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        return None
    built = manifest.get("versions") if isinstance(manifest.get("versions"), dict) else {}
    differ = [f"{k} {built.get(k)} (installed {versions[k]})" for k in ("neuron_infer", "torch")
              if built.get(k) != versions[k]]
    if differ:
        return CacheEntry(p, "artifact", "stale", tree_size(p), "built with " + ", ".join(differ))
    return CacheEntry(p, "artifact", "current", tree_size(p))


def _graph_entry(p: Path, versions: dict[str, str]) -> CacheEntry | None:
    if not KEY_RE.match(p.name):
        return None
    try:
        marker = parse_json((p / MARKER).read_bytes())
    except (OSError, ValueError):
        return None
    built = marker.get("versions") if isinstance(marker, dict) else None
    if not isinstance(built, dict):
        return None
    differ = [f"{k} {built.get(k)} (installed {v})" for k, v in versions.items() if built.get(k) != v]
    if differ:
        return CacheEntry(p, "graph", "stale", tree_size(p), "built with " + ", ".join(differ))
    return CacheEntry(p, "graph", "current", tree_size(p))


def _kernel_entry(p: Path) -> CacheEntry | None:
    """A cached C-kernel library (its name is the hash of its build command and sources, so it never goes stale:
    `prune --all` removes it)."""
    if p.is_symlink() or not p.is_file() or not _KERNEL_RE.match(p.name):
        return None
    return CacheEntry(p, "kernel", "current", tree_size(p))


def _partial_entry(p: Path, now: float) -> CacheEntry | None:
    regex = {"models": _MODEL_TMP_RE, "artifacts": _ARTIFACT_TMP_RE, "graphs": PARTIAL_RE}[p.parent.name]
    if not regex.fullmatch(p.name) or not is_marked(p):  # a name alone (e.g. a user's copy) is not ours
        return None
    age = now - p.stat().st_mtime
    state = "partial" if age > PARTIAL_AGE_S else "in progress"
    return CacheEntry(p, "partial", state, tree_size(p), f"interrupted build, {age / 60:.0f} min old")


# the files a converted model holds (transformers' save_pretrained of the model and its tokenizer, and our marker)
_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "chat_template.json", "added_tokens.json", SOURCE_FILE}
_SHARD_RE = re.compile(r"\Amodel-\d{5}-of-\d{5}\.safetensors\Z")


def owned_files(entry: CacheEntry) -> set[str] | None:
    """The relative paths of the files neuron-infer wrote into a model, artifact or graph entry (None: unknown)."""
    p = entry.path
    if entry.kind == "artifact":
        return artifact_files(p)
    if entry.kind == "graph":
        try:
            files = parse_json((p / MARKER).read_bytes()).get("files")
        except (OSError, ValueError, AttributeError):
            return None
        ok = isinstance(files, list) and all(isinstance(f, str) and Path(f).name == f for f in files)
        return {MARKER, *files} if ok else None
    if entry.kind == "model":
        return {f.name for f in p.iterdir() if f.name in _MODEL_FILES or _SHARD_RE.match(f.name)}
    return None


def _kept_if_foreign(entry: CacheEntry) -> CacheEntry:
    """`entry` itself, or (when it holds anything neuron-infer did not write) the same entry in state "kept", whose
    reason names what is in the way: prune never removes it."""
    if entry.kind not in ("model", "artifact", "graph"):
        return entry
    mine = owned_files(entry)
    if mine is None:
        return CacheEntry(entry.path, entry.kind, "kept", entry.size_bytes, "its marker lists no files neuron-infer "
                          "wrote (not a complete entry of ours): never pruned; remove it yourself if it is not yours")
    foreign = foreign_entries(entry.path, mine)
    if not foreign:
        return entry
    more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
    return CacheEntry(entry.path, entry.kind, "kept", entry.size_bytes,
                      f"holds {foreign[0]}{more}, which neuron-infer did not write: never pruned; move it out to let "
                      "prune remove this entry")


def scan(root: Path) -> list[CacheEntry]:
    """Every entry of the cache root (ours classified, the rest as "other"), sorted by path."""
    if not root.is_dir():
        return []
    gguf16, versions, now = _current_gguf_sha16(), package_versions(), time.time()
    graph_versions = current_versions()
    out: list[CacheEntry] = []
    for top in sorted(root.iterdir()):
        if top.name not in ("models", "artifacts", "graphs", "kernels") or top.is_symlink() or not top.is_dir():
            out.append(CacheEntry(top, "other", "other", 0, "not created by neuron-infer's cache"))
            continue
        for p in sorted(top.iterdir()):
            entry = None
            if top.name == "kernels":
                entry = _kernel_entry(p)
            elif p.is_dir() and not p.is_symlink():
                entry = _partial_entry(p, now) or {"models": lambda: _model_entry(p, gguf16),
                                                   "artifacts": lambda: _artifact_entry(p, versions),
                                                   "graphs": lambda: _graph_entry(p, graph_versions)}[top.name]()
            out.append(_kept_if_foreign(entry) if entry else
                       CacheEntry(p, "other", "other", 0, "not recognised as a neuron-infer entry"))
    return out


def prunable(entries: list[CacheEntry], everything: bool) -> list[CacheEntry]:
    """The entries `prune` removes: stale and partial ones; with `everything`, current ones too."""
    states = {"stale", "partial"} | ({"current"} if everything else set())
    return [e for e in entries if e.kind != "other" and e.state in states]


def remove(entry: CacheEntry) -> None:
    """Delete one of our entries (re-checked: never a symlink, never an "other", never one holding files that are
    not ours)."""
    if entry.kind == "other" or entry.path.is_symlink() or _kept_if_foreign(entry).state == "kept":
        raise ValueError(f"refusing to delete {entry.path}: not a neuron-infer cache entry, or it holds files "
                         "neuron-infer did not write")
    if entry.kind == "kernel":
        entry.path.unlink()
    else:
        shutil.rmtree(entry.path)
