"""Size fields bounded by what the files and the machine hold: a config.json or manifest.json size the weights do
not have is one `error:` line naming the field, at once (never a loop over 10^9 layers, a MemoryError or the
kernel's out-of-memory kill), and a KV cache larger than the memory available is refused before it is allocated.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neuron_infer.artifact.manifest import MANIFEST, seal
from neuron_infer.errors import NeuronInferError
from tests.test_fuzz_hostile import deadline, run
from tests.test_user_errors import TINY, cli, one_error
from tests.tiny_artifact import compile_tiny


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("sizes") / "a")


def edited_model(tiny_dirs, tmp_path: Path, **values) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **values}))
    return d


# (config.json values, words the error names); the tiny checkpoint has 2 layers, hidden 96, 4 x 24 query heads
CONFIG_SIZES = [
    ({"num_hidden_layers": 10**7}, ("num_hidden_layers=10000000", "2 layer(s)")),
    ({"num_hidden_layers": 3}, ("num_hidden_layers=3", "2 layer(s)")),
    ({"hidden_size": 10**9}, ("hidden_size=1000000000", "have 96")),
    ({"vocab_size": 10**5}, ("vocab_size=100000", "have 512")),
    ({"intermediate_size": 10**6}, ("intermediate_size=1000000", "have 200")),
    ({"num_attention_heads": 4096}, ("num_attention_heads=4096", "head_dim=24")),
    ({"num_key_value_heads": 1}, ("num_key_value_heads=1", "have 48")),
]


@pytest.mark.parametrize("values, words", CONFIG_SIZES, ids=[str(v) for v, _ in CONFIG_SIZES])
def test_config_sizes_are_bounded_by_the_weights(tiny_dirs, tmp_path, capsys, values, words):
    model = edited_model(tiny_dirs, tmp_path, **values)
    out = tmp_path / "out"
    commands = [["compile", model, "-o", out, *TINY, "--max-length", "1", "--context-buckets", "1",
                 "--tokengen-buckets", "1"], ["quantize", model, "-o", out, "--quant", "int8"]]
    for args in commands:
        with deadline(" ".join(map(str, args[:1])) + f" {values}"):
            one_error(*cli(args, capsys), "config.json", *words)
        assert not out.exists()


def resealed(art: Path, tmp_path: Path, section: str, key: str, value) -> Path:
    """A copy of `art` whose manifest says section.key=value, with the checksum rewritten to match (an edit the
    checksum cannot catch)."""
    root = tmp_path / "a"
    shutil.copytree(art, root)
    m = json.loads((root / MANIFEST).read_text())
    m[section][key] = value
    (root / MANIFEST).write_text(json.dumps(seal(m)))
    return root


@pytest.mark.parametrize("value", [10**9, 3, 1])
def test_a_manifest_layer_count_the_weights_do_not_hold(art, tmp_path, capsys, value):
    root = resealed(art, tmp_path, "model", "num_layers", value)
    code = run(["generate", root, "--prompt", "hi", "--max-new-tokens", "1"], capsys, f"num_layers={value}", True,
               [root])
    assert code == 2
    with deadline(f"load num_layers={value}"), pytest.raises(NeuronInferError, match=f"num_layers={value}"):
        from neuron_infer.api import CompiledModel

        CompiledModel.load(root)


def test_a_manifest_size_the_weights_do_not_have_is_one_line(art, tmp_path, capsys):
    root = resealed(art, tmp_path, "model", "hidden_size", 10**5)
    code, lines = cli(["generate", root, "--prompt", "hi", "--max-new-tokens", "1"], capsys)
    one_error(code, lines, "do not match", "recompile")
    assert len(lines) == 1, lines  # torch's several-line state_dict message, folded into the one line


def test_a_kv_cache_larger_than_the_available_memory_is_refused(art, capsys, monkeypatch):
    """No allocation the kernel would answer with an out-of-memory kill: the available memory is made small (so
    the test allocates nothing large)."""
    import psutil

    small = psutil.virtual_memory()._replace(available=64 * 1024)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: small)
    for extra in ([], ["--kv-cache-gib", "0.5"]):
        code, lines = cli(["generate", art, "--prompt", "hi", "--max-new-tokens", "1", *extra], capsys)
        one_error(code, lines, "KV cache", "available")


# ---- the batch a build runs: one definition (artifact/plan.py run_bytes) at compile time and at load ------------
GIB = 1 << 30


def machine(monkeypatch, total: int, available: int) -> None:
    """This machine's memory as psutil reports it (nothing large is allocated by the tests that use it)."""
    import psutil

    mem = psutil.virtual_memory()._replace(total=total, available=available)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem)


def no_conversion(monkeypatch) -> None:
    """A compile that reaches the checkpoint conversion fails the test: the sizing errors come before it."""
    from neuron_infer.compile import builder

    def converted(*_a, **_k):
        raise AssertionError("the checkpoint was converted before the sizing error")

    monkeypatch.setattr(builder, "load_checkpoint", converted)


@pytest.mark.parametrize("total, available, words", [
    (16 * GIB, 15 * GIB, ("needs", "GiB to run", "KV cache of 18.3 GiB", "logits of a full batch",
                          "this machine's 16.0 GiB of memory", "lower --batch-size or --max-length")),
    (64 * GIB, 15 * GIB, ("compiling a graph holds its example KV cache (18.3 GiB) twice", "at least 36.6 GiB",
                          "15.0 GiB of memory available", "lower --batch-size or --max-length, or free memory")),
], ids=["run", "compile"])
def test_an_impossible_batch_size_is_refused_before_any_work(tiny_dirs, tmp_path, capsys, monkeypatch, total,
                                                             available, words):
    """`compile --batch-size 100000` of the tiny checkpoint (bf16: a KV cache of 2 layers x 2 KV heads x 24 x 2
    bytes x 2 (K, V) x 100000 x 512 tokens = 18.3 GiB): one sizing error naming the bound and the fix, before the
    checkpoint is converted or any graph compiled; never the out-of-memory kill of a graph worker."""
    machine(monkeypatch, total, available)
    no_conversion(monkeypatch)
    out = tmp_path / "out"
    with deadline("compile --batch-size 100000"):
        one_error(*cli(["compile", tiny_dirs("gqa"), "-o", out, "--batch-size", "100000"], capsys),
                  "--batch-size 100000 x --max-length 512", *words)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags", [["--batch-size", str(2**31)], ["--batch-size", str(10**6)],
                                   ["--batch-size", str(2**63)], ["--batch-size", "9" * 30],
                                   ["--batch-size", "2", "--tokengen-batch-buckets", f"1,{10**12}"],
                                   ["--tokengen-batch-buckets", str(2**62)],
                                   ["--max-length", str(10**12)], ["--max-length", "9" * 30]])
def test_huge_batch_and_length_flags_are_one_error_before_any_work(tiny_dirs, tmp_path, capsys, monkeypatch,
                                                                   flags):
    machine(monkeypatch, 16 * GIB, 15 * GIB)
    no_conversion(monkeypatch)
    out = tmp_path / "out"
    with deadline(" ".join(flags)):
        run(["compile", tiny_dirs("gqa"), "-o", out, *TINY, *flags], capsys, " ".join(flags), True, [tmp_path])


def test_the_compile_and_the_load_check_the_same_memory(art, monkeypatch):
    """run_bytes is the bound of both checks: a compile of the tiny artifact's build is refused on a machine of one
    byte less, and so is its load with one byte less available; with exactly that much both pass. The logits of a
    full batch count (the KV cache alone would fit)."""
    from neuron_infer.api import CompiledModel
    from neuron_infer.artifact.manifest import read_manifest
    from neuron_infer.artifact.plan import kv_cache_shape, run_bytes
    from neuron_infer.compile.inputs import check_memory_fits
    from neuron_infer.errors import ConfigError

    m = read_manifest(art, verify_files=False)
    cache = kv_cache_shape(m.model, m.model.num_kv_heads, m.build)
    need = run_bytes(cache, m.build, m.model.vocab_size)
    assert need > cache.nbytes()
    machine(monkeypatch, need - 1, 64 * GIB)
    with pytest.raises(ConfigError, match="GiB to run"):
        check_memory_fits(m.model, m.build)
    machine(monkeypatch, need, 64 * GIB)
    check_memory_fits(m.model, m.build)
    machine(monkeypatch, 64 * GIB, need - 1)
    with pytest.raises(NeuronInferError, match=r"needs .* GiB \(a KV cache of .* GiB and the logits of a full batch"):
        CompiledModel.load(art)
    machine(monkeypatch, 64 * GIB, need)
    CompiledModel.load(art)


def test_graph_workers_are_bounded_by_their_example_kv_cache(tiny_dirs, tmp_path, monkeypatch):
    """Each graph worker holds the rank's default KV cache twice (its example inputs and export's copy): a cache
    that takes 4 GiB leaves room for one worker where an empty one leaves room for two."""
    from neuron_infer.artifact.plan import planned_graphs, shape_class
    from neuron_infer.compile import graph_workers
    from neuron_infer.config import BuildConfig, ModelConfig

    cfg, build = ModelConfig.from_model_dir(tiny_dirs("gqa")), BuildConfig()
    jobs = [(shape_class(spec, build), "key") for spec in planned_graphs(build)] * 3
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x" * 1000)
    monkeypatch.setattr("neuron_infer.cpu_threads.usable_cpus", lambda **_: 8)
    machine(monkeypatch, 64 * GIB, 2 * graph_workers.WORKER_BYTES + 2 * GIB)
    started = []
    monkeypatch.setattr(graph_workers, "run_workers", lambda named, module, n, say: started.append(n) or {})
    for cache_bytes in (0, 4 * GIB):
        graph_workers.compile_in_workers(jobs, weights, cfg, build, tmp_path, print, cache_bytes)
    assert started == [2, 1]


def test_sizes_are_checked_against_the_weights_before_the_memory(tiny_dirs, tmp_path, capsys):
    """A config.json of 10^7 layers is refused as a mismatch with the weights (the fix: the config), not as a KV
    cache too large for the machine (which would send the user to lower --batch-size)."""
    model = edited_model(tiny_dirs, tmp_path, num_hidden_layers=10**7)
    line = one_error(*cli(["compile", model, "-o", tmp_path / "out", *TINY], capsys), "num_hidden_layers=10000000",
                     "2 layer(s)")
    assert "--batch-size" not in line


def test_a_bad_flag_value_is_not_blamed_on_the_preset_file(tiny_dirs, tmp_path, capsys):
    line = one_error(*cli(["compile", tiny_dirs("gqa"), "-o", tmp_path / "out", "--batch-size", "0"], capsys),
                     "default.json: build with the flags given: batch_size=0 must be >= 1")
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"build": {"batch_size": 0}}))
    line = one_error(*cli(["compile", tiny_dirs("gqa"), "-o", tmp_path / "out", "--config", preset], capsys),
                     f"{preset}: build: batch_size=0")
    assert "flags" not in line
