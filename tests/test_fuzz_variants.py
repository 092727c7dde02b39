"""Variants of the hostile inputs of test_fuzz_hostile.py: a JSON key given twice, a cache root that is a file or a
link to nothing, weights of the wrong kind in an artifact whose manifest was rewritten to match. Each ends in one
`error:` line (exit 2) naming the problem, and nothing outside the command's output changes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from neuron_infer.artifact.manifest import MANIFEST, seal
from tests.test_fuzz_hostile import run
from tests.test_user_errors import TINY, cli, one_error
from tests.tiny_artifact import compile_tiny, relist

GENERATE = ["generate", "--prompt", "hi", "--max-new-tokens", "1"]


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("variants") / "a")


@pytest.fixture
def copy(art, tmp_path) -> Path:
    dst = tmp_path / "a"
    shutil.copytree(art, dst)
    return dst


def test_a_manifest_key_given_twice_is_refused(copy, capsys):
    """Python's json keeps the last of two equal keys, other readers the first: the file says two things, and the
    checksum (over the parsed manifest) cannot tell. Refused instead of read one way."""
    text = json.dumps(seal(json.loads((copy / MANIFEST).read_text())))
    (copy / MANIFEST).write_text(text.replace("{", '{"backend": "neuron", ', 1))
    for args in (GENERATE, ["info"]):
        code = run([args[0], copy, *args[1:]], capsys, f"{args[0]}: key twice", True, [copy])
        assert code == 2


def test_a_config_key_given_twice_is_refused(tiny_dirs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text.replace("{", '{"num_hidden_layers": 7, ', 1))
    one_error(*cli(["compile", model, "-o", tmp_path / "out", *TINY], capsys), "num_hidden_layers", "twice")


@pytest.mark.parametrize("root", ["file", "link to nothing", "link to a file"])
def test_a_cache_root_that_is_not_a_directory(tmp_path, capsys, monkeypatch, root):
    target = tmp_path / "target"
    path = tmp_path / "cache"
    if root == "file":
        path.write_text("mine")
    else:
        if root == "link to a file":
            target.write_text("mine")
        path.symlink_to(target)
    monkeypatch.setenv("NEURON_INFER_CACHE", str(path))
    for args in (["cache", "list"], ["cache", "prune", "--all"], GENERATE):
        one_error(*cli(args, capsys), str(path), "NEURON_INFER_CACHE")
    assert path.is_symlink() or path.read_text() == "mine"
    assert not target.exists() or target.read_text() == "mine"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_artifact_weights_of_the_wrong_kind(copy, capsys, dtype):
    """An integer tensor where the model holds floats (manifest rewritten to match): one error naming the tensor."""
    from safetensors.torch import load_file, save_file

    weights = copy / "weights" / "rank0.safetensors"
    state = load_file(weights)
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].to(dtype)
    save_file(state, weights)
    relist(copy)
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), name, str(dtype))


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_an_output_that_is_a_link_is_named_as_one(tiny_dirs, tmp_path, capsys, overwrite):
    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(user)
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", link, *TINY, *overwrite], capsys), "symbolic link", str(user))
    assert link.is_symlink() and [p.name for p in user.iterdir()] == ["keep.txt"]
