"""Variants of the hostile inputs of test_fuzz_hostile.py: a JSON key given twice, a cache root that is a file or a
link to nothing, weights of the wrong kind in an artifact whose manifest was rewritten to match. Each ends in one
`error:` line (exit 2) naming the problem, and nothing outside the command's output changes."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from neuron_infer.artifact.manifest import MANIFEST, seal
from neuron_infer.errors import NeuronInferError
from tests.test_fuzz_hostile import run
from tests.test_user_errors import TINY, cli, one_error
from tests.tiny_artifact import compile_tiny, rewrite_weights

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


def fail_on_graph_run(monkeypatch):
    """A step graph that runs fails the test: the refusal must come at load, before any graph runs."""
    from neuron_infer.runtime.engine import Engine

    def run(*_a, **_k):
        raise AssertionError("a graph ran before the weights were refused")

    monkeypatch.setattr(Engine, "_run", run)


DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.uint8])
def test_artifact_weights_of_another_dtype(copy, capsys, monkeypatch, dtype):
    """fp32 artifact, one tensor rewritten as `dtype` (same name and shape, manifest rewritten to match): one error at
    load naming the tensor and both dtypes, from the file's header, before any graph runs."""
    from neuron_infer.api import CompiledModel

    rewrite_weights(copy, lambda s: s.__setitem__(DOWN, s[DOWN].to(dtype)))
    fail_on_graph_run(monkeypatch)
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), DOWN, str(dtype), "torch.float32", "recompile")
    with pytest.raises(NeuronInferError, match=DOWN):
        CompiledModel.load(copy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_whole_fp32_artifact_rewritten_in_half_precision(copy, capsys, dtype):
    rewrite_weights(copy, lambda s: s.update({k: v.to(dtype) for k, v in s.items()}))
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), ".weight is stored as", str(dtype), "torch.float32")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", [DOWN, "model.embed_tokens.weight", "model.norm.weight"])
def test_nan_or_inf_artifact_weights_are_refused_at_load(copy, capsys, name, bad):
    def edit(state):
        state[name].view(-1)[5] = bad

    rewrite_weights(copy, edit)
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), name, "NaN or infinite", "recompile")


def test_huge_finite_weights_still_load(copy, capsys):
    """Values whose sum overflows (the finiteness check's fast path) are finite: the element-wise check accepts them."""
    def edit(state):
        state[DOWN].view(-1)[:4] = 3e38

    rewrite_weights(copy, edit)
    code, lines = cli([GENERATE[0], copy, *GENERATE[1:]], capsys)
    assert code == 0, lines


@pytest.mark.parametrize("edit", ["missing", "extra", "shape"])
def test_artifact_weights_with_other_names_or_shapes(copy, capsys, edit):
    def change(state):
        if edit == "missing":
            del state["model.layers.1.input_layernorm.weight"]
        elif edit == "extra":
            state["model.rotary.weight"] = torch.ones(96)
        else:
            state[DOWN] = state[DOWN][:, :-1].contiguous()

    rewrite_weights(copy, change)
    words = {"missing": ["missing", "model.layers.1.input_layernorm.weight"],
             "extra": ["unexpected", "model.rotary.weight"], "shape": [DOWN, "shape"]}[edit]
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), *words)


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_an_output_that_is_a_link_is_named_as_one(tiny_dirs, tmp_path, capsys, overwrite):
    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(user)
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", link, *TINY, *overwrite], capsys), "symbolic link", str(user))
    assert link.is_symlink() and [p.name for p in user.iterdir()] == ["keep.txt"]


def test_a_weights_file_swapped_after_its_header_check(art, tmp_path, capsys, monkeypatch):
    """The tensors read are checked again as they are read: a file swapped between the header check and the read
    (fp16 weights) is refused as well."""
    from safetensors.torch import load_file, save_file

    from neuron_infer.artifact import weights

    swapped = tmp_path / "swapped.safetensors"
    state = load_file(art / "weights" / "rank0.safetensors")
    state[DOWN] = state[DOWN].half()
    save_file(state, swapped)
    real = weights.Expected.check_header

    def check_then_swap(self, path, what):
        real(self, path, what)
        shutil.copyfile(swapped, path)

    root = tmp_path / "a"
    shutil.copytree(art, root)
    monkeypatch.setattr(weights.Expected, "check_header", check_then_swap)
    one_error(*cli([GENERATE[0], root, *GENERATE[1:]], capsys), DOWN, "torch.float16")
