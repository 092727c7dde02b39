"""The compile cache: compiled graphs keyed by what determines their code, shared by every artifact on a machine.

    <cache>/graphs/<key>/      the backend's files of one compiled graph + neuron_infer_graph.json (the marker)
    <cache>/graphs/.<key>.partial-*   an entry being written (renamed into place when complete)

<cache> is `$NEURON_INFER_CACHE`, else `~/.cache/neuron-infer` (neuron_infer.embedded.cache_dir).

The key hashes the graph's inputs, never the artifact's folder: the package version and a hash of the source
files that generate graph code (model/, quant/, the CPU backend and its C kernels), the torch version, the model
config, the build, the graph's shape class (its name, example inputs and dynamic dims), the backend's compile
options and the ISA level of its C kernels, and the shapes and dtypes of the weights the graph reads. Weights are
not part of a graph (they are bound at load), so two checkpoints of one architecture share graphs. A hit copies the
entry's files into the artifact, which records their hashes as usual: an artifact never depends on the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from neuron_infer import __version__
from neuron_infer.embedded import cache_dir
from neuron_infer.output_dir import PARTIAL_MARKER, mark
from neuron_infer.typed import parse_json

MARKER = "neuron_infer_graph.json"
KEY_RE = re.compile(r"\A[0-9a-f]{32}\Z")
PARTIAL_RE = re.compile(r"\A\.[0-9a-f]{32}\.partial-\d+\Z")
_SOURCES = ("model", "quant", "shapes.py", "backends/cpu")  # what generates graph code: files or folders


def graphs_root() -> Path:
    return cache_dir() / "graphs"


@lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the package sources that generate graph code (file names and bytes, in sorted order)."""
    pkg = Path(__file__).resolve().parent.parent
    files: list[Path] = []
    for rel in _SOURCES:
        p = pkg / rel
        files += sorted(f for f in p.rglob("*") if f.suffix in (".py", ".cpp", ".h")) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def current_versions() -> dict[str, str]:
    """What makes a cached graph current: this package version, its graph sources and the torch version."""
    import torch


    return {"neuron_infer": __version__, "sources": source_hash()[:16], "torch": torch.__version__}


def graph_key(parts: dict[str, Any]) -> str:
    """The cache key of a graph: sha256 of `parts` (JSON) with the package version and source hash; 32 hex."""
    full = {**current_versions(), "sources": source_hash(), **parts}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_lookup(key: str, out_dir: Path, root: Path | None = None) -> dict | None:
    """Copy the cached graph of `key` into out_dir -> its metadata (with "cache": "hit"), or None (not cached)."""
    entry = (root or graphs_root()) / key
    meta = _read_entry(entry)
    if meta is None:
        return None
    try:
        for name in meta["files"]:
            shutil.copy2(entry / name, out_dir / name)
        os.utime(entry)  # recently used
    except OSError:
        return None  # a damaged entry: compiled again
    return {**meta, "cache": "hit"}


def cached_compile(key: str, out_dir: Path, compile_into: Callable[[Path], dict], root: Path | None = None) -> dict:
    """The compiled graph of `key` in out_dir: copied from the cache, or compiled by compile_into(out_dir) (-> its
    metadata, with "files" relative to out_dir) and then stored. Returns the metadata, with "cache": "hit" or
    "miss". A cache that cannot be read or written is skipped (the compile still runs)."""
    hit = cached_lookup(key, out_dir, root)
    if hit is not None:
        return hit
    entry = (root or graphs_root()) / key
    meta = compile_into(out_dir)
    _store(entry, out_dir, meta)
    return {**meta, "cache": "miss"}


def _read_entry(entry: Path) -> dict | None:
    try:
        meta = parse_json((entry / MARKER).read_bytes())
    except (OSError, ValueError):
        return None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and Path(f).name == f for f in files):
        return None
    return meta


def _store(entry: Path, out_dir: Path, meta: dict) -> None:
    """Copy a fresh compile into the cache, atomically (a partial directory renamed into place)."""
    tmp = entry.parent / f".{entry.name}.partial-{os.getpid()}"
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        mark(tmp)  # an interrupted store is ours to prune
        for name in meta["files"]:
            shutil.copy2(out_dir / name, tmp / name)
        marker = {**meta, "stored": time.time(), "versions": current_versions()}
        (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True))
        (tmp / PARTIAL_MARKER).unlink()
        tmp.rename(entry)  # fails if the entry exists (another compile stored it, or a damaged one: kept as is)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # read-only or full cache: the artifact has its files anyway
