"""The Neuron target's NEFF cache and parallel bucket compiles (backends/neuron/cache.py, compile/neuron_workers.py)
through the recording double of torch-neuronx, whose calls are bound against the real SDK signatures
(tests/compile/neuron_sdk_signatures.py). Not yet run on hardware.

The SDK versions are read the way the backend reads them on an instance, from installed pip distributions: each
test installs `neuronx-cc` / `torch-neuronx` dist-info metadata (no code) into a temporary site directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from neuron_infer.api import CompiledModel
from neuron_infer.backends.neuron import cache as neuron_cache
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.compile import graph_workers
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig
from tests.compile.neuron_doubles import RecordingNeuronSDK

BUILD = BuildConfig(target="neuron", dtype="fp32", max_context_length=32, max_length=64,
                    context_buckets=(16, 32), tokengen_buckets=(64,))
GRAPHS = ["context_t16_s16", "context_t16_s32", "context_t32_s32", "tokengen_t1_s64"]
SITE = Path(__file__).parent / "neuron_site"   # the double as an installed `torch_neuronx` module
REPO = Path(__file__).resolve().parents[2]
QUIET = {"say": lambda m: None}


def install_versions(root: Path, cc: str = "2.27.5334.0", tnx: str = "2.9.0.2.15.32035") -> Path:
    """A site directory holding the metadata pip writes for neuronx-cc and torch-neuronx (names and versions)."""
    site = root / f"site-{cc}-{tnx}"
    for dist, version in (("neuronx-cc", cc), ("torch-neuronx", tnx)):
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return site


@pytest.fixture(autouse=True)
def neuron_env(monkeypatch, tmp_path):
    """A private Neuron cache; no compiler flags, LNC or platform from the environment."""
    for name in (LNC_ENV, PLATFORM_ENV, neuron_cache.CC_FLAGS_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv(neuron_cache.CACHE_URL_ENV, str(tmp_path / "neuron-cache"))


@pytest.fixture
def sdk(monkeypatch, tmp_path):
    """The in-process double with the SDK versions installed (bucket compiles then run in this process)."""
    fake = RecordingNeuronSDK()
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    monkeypatch.syspath_prepend(str(install_versions(tmp_path)))
    return fake


def _traces(sdk) -> int:
    return sum(1 for name, _ in sdk.calls if name == "trace")


def _graph_bytes(artifact: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((artifact / "graphs").iterdir())}


def test_an_identical_rebuild_into_another_folder_reuses_every_neff(sdk, tiny_dirs, tmp_path):
    d = tiny_dirs("gqa")
    first = compile_model(d, tmp_path / "a", BUILD, **QUIET)
    assert _traces(sdk) == 4 and {g["cache"] for g in first.graphs.values()} == {"miss"}
    entries = sorted((tmp_path / "neuron-cache" / "neuron-infer").iterdir())
    assert len(entries) == 4 and all((e / "neuron_infer_graph.json").is_file() for e in entries)
    second = compile_model(d, tmp_path / "b", BUILD, **QUIET)
    assert _traces(sdk) == 4                                        # no trace: the compiler ran zero times
    assert {g["cache"] for g in second.graphs.values()} == {"hit"}
    assert _graph_bytes(tmp_path / "a") == _graph_bytes(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b" / "graphs").iterdir()) == sorted(
        f"{g}{ext}" for g in GRAPHS for ext in (".pt", ".neuron.json"))   # no neuronx-cc workdir in the artifact
    prompt = [list(range(5, 25))]
    got = CompiledModel.load(tmp_path / "b").generate_ids(prompt, 20, ignore_eos=True)   # files verified by hash
    ref = CompiledModel.load(tmp_path / "a").generate_ids(prompt, 20, ignore_eos=True)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_changed_compiler_version_flag_or_lnc_misses(sdk, monkeypatch, tiny_dirs, tmp_path):
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "base", BUILD, **QUIET)
    assert _traces(sdk) == 4
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, "--log_level=INFO")         # forwarded to neuronx-cc
    compile_model(d, tmp_path / "flags", BUILD, **QUIET)
    assert _traces(sdk) == 8
    monkeypatch.delenv(neuron_cache.CC_FLAGS_ENV)
    compile_model(d, tmp_path / "lnc1", BUILD.replace(lnc=1), **QUIET)           # --lnc=1 instead of 2
    assert _traces(sdk) == 12
    monkeypatch.syspath_prepend(str(install_versions(tmp_path, cc="2.28.1.0")))
    compile_model(d, tmp_path / "cc", BUILD, **QUIET)
    assert _traces(sdk) == 16
    monkeypatch.syspath_prepend(str(install_versions(tmp_path, cc="2.28.1.0", tnx="2.9.0.2.16.1")))
    compile_model(d, tmp_path / "tnx", BUILD, **QUIET)
    assert _traces(sdk) == 20
    compile_model(d, tmp_path / "again", BUILD, **QUIET)                        # the last setup is now cached
    assert _traces(sdk) == 20


def test_no_cache_and_an_unknown_compiler_version_compile_without_storing(monkeypatch, tiny_dirs, tmp_path):
    sdk = RecordingNeuronSDK()
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    d = tiny_dirs("gqa")
    m = compile_model(d, tmp_path / "a", BUILD, **QUIET)                        # no neuronx-cc distribution
    assert {g["cache"] for g in m.graphs.values()} == {"off"}
    monkeypatch.syspath_prepend(str(install_versions(tmp_path)))
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, "--no_cache")                # the SDK's documented switch
    compile_model(d, tmp_path / "b", BUILD, **QUIET)
    compile_model(d, tmp_path / "c", BUILD, **QUIET)
    assert _traces(sdk) == 12 and not (tmp_path / "neuron-cache").exists()


def test_the_cache_directory_is_resolved_as_the_sdk_documents(monkeypatch, tmp_path):
    monkeypatch.delenv(neuron_cache.CACHE_URL_ENV)
    assert neuron_cache.neff_cache_root() == Path("/var/tmp/neuron-compile-cache/neuron-infer")
    monkeypatch.setenv(neuron_cache.CACHE_URL_ENV, f"file://{tmp_path}/env")
    assert neuron_cache.neff_cache_root() == tmp_path / "env" / "neuron-infer"
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, f"-O1 --cache_dir={tmp_path}/flag --log_level=INFO")
    assert neuron_cache.neff_cache_root() == tmp_path / "flag" / "neuron-infer"   # --cache_dir wins
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, "--cache_dir=s3://bucket/cache")
    monkeypatch.setenv("NEURON_INFER_CACHE", str(tmp_path / "ours"))
    assert neuron_cache.neff_cache_root() == tmp_path / "ours" / "graphs"        # S3 is not written by us
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, "--no_cache")
    assert neuron_cache.neff_cache_root() is None
    monkeypatch.setenv(neuron_cache.CC_FLAGS_ENV, "--log_level='INFO --no_cache")  # unbalanced quote: no error
    assert neuron_cache.neff_cache_root() is None


class _Tiny(torch.nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))
        self.register_buffer("table", torch.arange(n, dtype=torch.float32), persistent=False)

    def forward(self, x):
        return x * self.w + self.table


def test_the_key_covers_buffer_bytes_and_parameter_shapes_but_not_parameter_values(monkeypatch, tmp_path):
    """Parameters are bound at load (replace_weights), so their values are not in a NEFF; any other tensor may be
    folded into it as a constant."""
    monkeypatch.syspath_prepend(str(install_versions(tmp_path)))
    args, record, cc = (torch.zeros(4),), {"platform": "trn2", "lnc": 2}, ["--lnc=2"]

    def key(m: torch.nn.Module) -> str:
        return neuron_cache.neff_key(m, args, "g", record, cc, BUILD)

    base, other_weights, other_table = _Tiny(), _Tiny(), _Tiny()
    with torch.no_grad():
        other_weights.w.fill_(3.0)
        other_table.table[0] = 7.0
    assert key(base) == key(other_weights)
    assert key(base) != key(other_table)
    assert key(base) != key(_Tiny(8))
    assert key(base) != neuron_cache.neff_key(base, (torch.zeros(4, dtype=torch.float64),), "g", record, cc, BUILD)
    assert key(base) != neuron_cache.neff_key(base, args, "g", {"platform": "trn3", "lnc": 2}, cc, BUILD)


def test_a_damaged_entry_is_traced_again(sdk, tiny_dirs, tmp_path):
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "a", BUILD, **QUIET)
    entry = next(e for e in (tmp_path / "neuron-cache" / "neuron-infer").iterdir()
                 if (e / "tokengen_t1_s64.pt").is_file())
    (entry / "tokengen_t1_s64.pt").unlink()
    m = compile_model(d, tmp_path / "b", BUILD, **QUIET)
    assert _traces(sdk) == 5 and m.graphs["tokengen_t1_s64"]["cache"] == "miss"
    CompiledModel.load(tmp_path / "b")                                          # every file listed and verified


def test_workers_are_bounded_by_cores_and_memory(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr("neuron_infer.cpu_threads.usable_cpus", lambda **_: 8)
    monkeypatch.setattr("psutil.virtual_memory", lambda: types.SimpleNamespace(available=30 * gib, total=32 * gib))
    assert graph_workers.worker_count(10, 2 * gib, 8 * gib) == 3               # 30 GiB / (8 + 2) GiB
    assert graph_workers.worker_count(2, 2 * gib, 8 * gib) == 2                # no more workers than buckets
    monkeypatch.setattr("neuron_infer.cpu_threads.usable_cpus", lambda **_: 2)
    assert graph_workers.worker_count(10, 0, 1 * gib) == 2                     # the usable cores
    monkeypatch.setattr("psutil.virtual_memory", lambda: types.SimpleNamespace(available=gib, total=32 * gib))
    assert graph_workers.worker_count(10, 2 * gib, 8 * gib) == 1               # at least one


def test_misses_are_traced_in_worker_processes_and_an_identical_rebuild_in_none(monkeypatch, tiny_dirs, tmp_path):
    """The double installed as a module file (tests/compile/neuron_site), imported by this process and by every
    worker; each trace is logged with its process id."""
    log = tmp_path / "traces.jsonl"
    site = install_versions(tmp_path)
    monkeypatch.setenv("NEURON_DOUBLE_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), str(site), str(REPO)]))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(SITE))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    monkeypatch.setattr("neuron_infer.cpu_threads.usable_cpus", lambda **_: 2)
    monkeypatch.setattr("psutil.virtual_memory", lambda: types.SimpleNamespace(available=64 << 30, total=64 << 30))
    said: list[str] = []
    d = tiny_dirs("gqa")
    m = compile_model(d, tmp_path / "a", BUILD, say=said.append)
    traces = [json.loads(line) for line in log.read_text().splitlines()]
    assert any("4 graphs in 2 worker processes" in s for s in said)
    assert len(traces) == 4 and os.getpid() not in {t["pid"] for t in traces}
    assert {t["args"][-1] for t in traces} == {"--lnc=2"}                      # the parent's resolved target
    assert {g["cache"] for g in m.graphs.values()} == {"miss"}
    compile_model(d, tmp_path / "eager", BUILD.replace(target="cpu"), backend="cpu-eager", **QUIET)
    prompt = [list(range(5, 25))]
    got = CompiledModel.load(tmp_path / "a").generate_ids(prompt, 20, ignore_eos=True)
    ref = CompiledModel.load(tmp_path / "eager").generate_ids(prompt, 20, ignore_eos=True)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    code = ("import sys; from neuron_infer.compile.builder import compile_model; from neuron_infer.config import "
            f"BuildConfig; compile_model(sys.argv[1], sys.argv[2], BuildConfig.from_dict({BUILD.to_dict()!r}))")
    subprocess.run([sys.executable, "-c", code, str(d), str(tmp_path / "b")], check=True, capture_output=True)
    assert len(log.read_text().splitlines()) == 4                 # another process: all hits, no worker, no trace
    assert _graph_bytes(tmp_path / "a") == _graph_bytes(tmp_path / "b")


def test_each_buffer_is_hashed_once_per_compile(sdk, monkeypatch, tiny_dirs, tmp_path):
    """The buckets of one compile share the model's buffers: their bytes are read once, not once per bucket."""
    seen: list[tuple] = []
    real = neuron_cache.tensor_digest

    def counting(t):
        seen.append((t.data_ptr(), tuple(t.shape)))
        return real(t)

    monkeypatch.setattr(neuron_cache, "tensor_digest", counting)
    compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD, **QUIET)
    assert seen and len(seen) == len(set(seen))
