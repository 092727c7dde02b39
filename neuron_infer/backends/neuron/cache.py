"""The persistent NEFF cache of the Neuron target: one entry per bucket graph, keyed by what determines its NEFF.
NOT YET RUN ON HARDWARE.

    <neuron cache>/neuron-infer/<key>/   <graph>.pt + <graph>.neuron.json + neuron_infer_graph.json (the marker)

<neuron cache> is the Neuron persistent cache directory, resolved as the SDK documents it (neuron-caching.rst,
pytorch-neuron-parallel-compile.rst): `--cache_dir=<url>` in NEURON_CC_FLAGS, else NEURON_COMPILE_CACHE_URL, else
/var/tmp/neuron-compile-cache. The SDK keeps its own entries there under `neuronxcc-<version>/MODULE_<hash>/`;
ours live in the `neuron-infer/` subdirectory, so the two never collide. The SDK documents its cache for
torch-xla graphs and says traced graphs with frozen weights are not cached; whether a trace with
`inline_weights_to_neff=False` is is not documented, hence this cache of whole traced graphs. `--no_cache` in
NEURON_CC_FLAGS (the documented switch) turns it off; an `s3://` cache (which the SDK supports) is not written by
neuron-infer: its entries then go to neuron-infer's own cache (`<cache>/graphs`, backends/graph_cache.py).

The key (compile/graph_cache.graph_key, which adds the package version, its graph sources and torch) covers:
the neuronx-cc and torch-neuronx versions (pip distributions `neuronx-cc`, `torch-neuronx`); the compiler
arguments and NEURON_CC_FLAGS (torch-neuronx forwards those to neuronx-cc); the platform and LNC; the sources of the
Neuron backend and the NKI kernels; the graph name, the example input shapes and dtypes; every ModelConfig in the
module and the build; the module's structure (repr), the shapes and dtypes of its parameters (bound at load by
`replace_weights`, never in the NEFF) and the bytes of every other tensor (buffers: RoPE tables, head maps, and
quantized weights, which a trace may fold into the NEFF as constants). When the neuronx-cc version cannot be read
the graph is compiled and not cached. Entries are written and read by backends/graph_cache.py (atomic rename, a hit
copies the files into the artifact, which hashes them as usual).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from neuron_infer.backends.graph_cache import graph_key, graphs_root
from neuron_infer.config import ModelConfig

DEFAULT_CACHE_URL = "/var/tmp/neuron-compile-cache"  # the SDK's default (neuron-caching.rst)
CACHE_URL_ENV = "NEURON_COMPILE_CACHE_URL"
CC_FLAGS_ENV = "NEURON_CC_FLAGS"
SUBDIR = "neuron-infer"
SDK_DISTRIBUTIONS = ("neuronx-cc", "torch-neuronx")
_CACHE_DIR_RE = re.compile(r"--cache_dir[= ](\S+)")
_NEURON_SOURCES = ("backends/neuron/graph.py", "backends/neuron/platform.py")


def cc_flags() -> str:
    return os.environ.get(CC_FLAGS_ENV, "").strip()


def cache_url() -> str | None:
    """The Neuron persistent cache URL as the SDK resolves it, or None when NEURON_CC_FLAGS has `--no_cache`."""
    flags = cc_flags()
    if "--no_cache" in flags.split():
        return None
    explicit = _CACHE_DIR_RE.search(flags)
    if explicit:
        return explicit.group(1)
    return os.environ.get(CACHE_URL_ENV, "").strip() or DEFAULT_CACHE_URL


def neff_cache_root() -> Path | None:
    """Where neuron-infer's NEFF entries go: `<Neuron cache>/neuron-infer` for a local cache (a `file://` URL or a
    path), `<neuron-infer cache>/graphs` for a remote one, None when caching is off."""
    url = cache_url()
    if url is None:
        return None
    url = url.removeprefix("file://")
    if "://" in url:  # s3:// and any other remote store: not written by neuron-infer
        return graphs_root()
    return Path(url).expanduser() / SUBDIR


def sdk_versions() -> dict[str, str] | None:
    """The installed versions of the pip distributions neuronx-cc and torch-neuronx, or None if one is absent."""
    try:
        return {d: importlib.metadata.version(d) for d in SDK_DISTRIBUTIONS}
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def neuron_source_hash() -> str:
    """sha256 over the Neuron backend's sources and the NKI kernels (graph_cache.source_hash covers the model)."""
    pkg = Path(__file__).resolve().parents[2]  # neuron_infer/
    files = [pkg / rel for rel in _NEURON_SOURCES]
    kernels = pkg.parent / "nki_kernels"
    files += sorted(kernels.rglob("*.py")) if kernels.is_dir() else []
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)  # [numel * itemsize] raw bytes
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(data.numpy().tobytes())
    return h.hexdigest()


def _digest(t: torch.Tensor, memo: dict) -> str:
    """tensor_digest, once per tensor storage and view within one compile (every bucket shares the model's)."""
    key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
    if key not in memo:
        memo[key] = tensor_digest(t)
    return memo[key]


def module_parts(module: torch.nn.Module, digests: dict | None = None) -> dict[str, Any]:
    """What of a module determines its traced graph: structure, configs, parameter shapes, buffer bytes.
    `digests`: a memo of buffer digests shared by the graphs of one compile (their model's tensors do not change)."""
    memo = {} if digests is None else digests
    configs = {name: m.cfg.to_dict() for name, m in module.named_modules()
               if isinstance(getattr(m, "cfg", None), ModelConfig)}
    params = {k: [list(p.shape), str(p.dtype)] for k, p in module.named_parameters()}
    buffers = {k: _digest(b, memo) for k, b in module.named_buffers() if b is not None}
    return {"module": type(module).__qualname__, "repr": repr(module), "configs": configs, "params": params,
            "buffers": buffers}


def neff_key(module: torch.nn.Module, example_args: tuple, graph_name: str, record: dict[str, Any],
             compiler_args: list[str], build: Any, digests: dict | None = None) -> str | None:
    """The cache key of one traced graph, or None when it cannot be keyed (neuronx-cc version unknown)."""
    versions = sdk_versions()
    if versions is None:
        return None
    args = [[list(a.shape), str(a.dtype)] for a in example_args]
    return graph_key({"backend": "neuron", "sdk": versions, "compiler_args": list(compiler_args),
                      "cc_flags": cc_flags(), "target": record, "neuron_sources": neuron_source_hash(),
                      "graph": graph_name, "args": args, "build": build.to_dict() if build is not None else None,
                      **module_parts(module, digests)})
