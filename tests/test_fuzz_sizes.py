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
