"""Input a user can get wrong: one `error: ...` line naming the problem, exit status 2, never a traceback.

Config and manifest values of the wrong type, missing keys, paths that do not exist, outputs that cannot be
written (a full disk and a read-only file system are simulated by raising the OSError at the write layer),
prompts that are not UTF-8 text and non-finite sampling values.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_infer.artifact.manifest import MANIFEST, seal
from neuron_infer.cli import main

TINY = ["--config", "tiny", "--backend", "cpu-eager"]
REPO = Path(__file__).resolve().parent.parent


def cli(args: list[str], capsys) -> tuple[int, list[str]]:
    """Run the CLI in this process: (exit status, stderr lines). An exception escaping main() fails the test."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().err.splitlines()


def one_error(code: int, lines: list[str], *words: str) -> str:
    """The single `error:` line of a run that failed cleanly with status 2; it must contain every word."""
    assert code == 2, lines
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and not any("Traceback" in ln for ln in lines), lines
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def model_copy(tiny_dirs, tmp_path: Path, edit=None) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), d)
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        cfg = edit(cfg) or cfg
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory) -> Path:
    from neuron_infer.api import compile_model
    from neuron_infer.presets import load_preset

    out = tmp_path_factory.mktemp("errors") / "art"
    compile_model(tiny_dirs("gqa"), out, load_preset("tiny").build, backend="cpu-eager", say=lambda m: None)
    return out


# ---- config.json ------------------------------------------------------------------------------------------------

def _drop_heads(c):
    del c["num_attention_heads"]


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.update(hidden_size="abc"), ("hidden_size", '"abc"')),
    (lambda c: c.update(hidden_size=None), ("hidden_size", "null")),
    (lambda c: [c], ("config.json", "must be a JSON object")),
    (_drop_heads, ("num_attention_heads", "missing")),
    (lambda c: c.update(num_hidden_layers=2.7), ("num_hidden_layers", "2.7")),
])
def test_bad_config_json_values(tiny_dirs, tmp_path, capsys, edit, words):
    d = model_copy(tiny_dirs, tmp_path, edit)
    out = tmp_path / "art"
    one_error(*cli(["compile", d, "-o", out, *TINY], capsys), *words)
    assert not out.exists()
    one_error(*cli(["plan", d, "--instance", "trn1.2xlarge", "--tp-degree", "1"], capsys), *words)


def test_config_json_that_is_not_utf8(tiny_dirs, tmp_path, capsys):
    d = model_copy(tiny_dirs, tmp_path)
    (d / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    one_error(*cli(["compile", d, "-o", tmp_path / "art", *TINY], capsys), "config.json", "not UTF-8")


@pytest.mark.parametrize("command", [["compile", "{d}", "-o", "{o}", *TINY],
                                     ["plan", "{d}", "--instance", "trn1.2xlarge", "--tp-degree", "1"]])
def test_nonexistent_model_dir_is_reported_as_such(tmp_path, capsys, command):
    args = [a.format(d=tmp_path / "no-such-model", o=tmp_path / "art") for a in command]
    line = one_error(*cli(args, capsys), "no-such-model", "does not exist")
    assert "config.json not found" not in line


def test_nonexistent_artifact_dir_is_reported_as_such(tmp_path, capsys):
    one_error(*cli(["generate", tmp_path / "no-such-art", "--prompt", "x"], capsys), "no-such-art", "does not exist")


# ---- manifest.json ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda m: [m], ("manifest.json", "must be a JSON object", "recompile")),
    (lambda m: m.update(files=["weights/rank0.safetensors"]), ("files", "must be a JSON object")),
    (lambda m: m["build"].update(max_length="128"), ("build.max_length", "must be an integer")),
    (lambda m: m["model"].update(num_layers=2.5), ("model.num_layers", "2.5")),
])
def test_bad_manifest_values(artifact, tmp_path, capsys, edit, words):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    m = json.loads((art / MANIFEST).read_text())
    m = edit(m) or m
    (art / MANIFEST).write_text(json.dumps(seal(m)))
    one_error(*cli(["generate", art, "--prompt", "hi", "--max-new-tokens", "1"], capsys), *words)


# ---- the output directory ---------------------------------------------------------------------------------------

def test_output_under_a_file(tiny_dirs, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", tmp_path / "afile" / "sub", *TINY], capsys),
              "afile", "is a file, not a directory")


def test_output_on_a_full_disk(tiny_dirs, tmp_path, monkeypatch, capsys):
    from neuron_infer.compile import builder

    def full(*a, **k):  # what write() raises when the disk fills up: ENOSPC, no file name
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(builder, "save_rank_weights", full)
    out = tmp_path / "out" / "art"
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", out, *TINY], capsys),
              f"cannot write {out}", os.strerror(errno.ENOSPC), "free some space")
    assert list((tmp_path / "out").iterdir()) == [], "the partial compile is removed"


def test_output_on_a_full_disk_while_safetensors_writes(tiny_dirs, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from neuron_infer.artifact import weights

    def full(*a, **k):  # what safetensors' writer raises on a full disk (its text carries the OS error)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(weights, "save_file", full)
    out = tmp_path / "out" / "art"
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", out, *TINY], capsys),
              f"cannot write {out}", os.strerror(errno.ENOSPC))
    assert list((tmp_path / "out").iterdir()) == []


def test_quantize_output_on_a_full_disk(tiny_dirs, tmp_path, monkeypatch, capsys):
    from safetensors import torch as st_torch

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(st_torch, "save_file", full)
    out = tmp_path / "out" / "q"
    one_error(*cli(["quantize", tiny_dirs("gqa"), "-o", out, "--quant", "int8"], capsys),
              f"cannot write {out}", os.strerror(errno.ENOSPC), "free some space")
    assert list((tmp_path / "out").iterdir()) == [], "the partial output is removed"


@pytest.mark.parametrize("command", [["compile", "{m}", "-o", "{f}", *TINY], ["quantize", "{m}", "-o", "{f}/q", "--quant",
                                     "int8"], ["info", "{f}"], ["quantize", "{f}", "-o", "{o}", "--quant", "int8"]])
def test_a_file_where_a_directory_belongs(tiny_dirs, tmp_path, capsys, command):
    """Our own one-line error (not a usage screen) names the file for every path argument."""
    (tmp_path / "afile").write_text("x")
    args = [a.format(m=tiny_dirs("gqa"), f=tmp_path / "afile", o=tmp_path / "out") for a in command]
    one_error(*cli(args, capsys), "afile", "is a file")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("make, words", [(lambda p: None, ("No such file",)), (lambda p: p.mkdir(), ("directory",))])
def test_prompt_file_that_cannot_be_read(artifact, tmp_path, capsys, make, words):
    path = tmp_path / "prompts.txt"
    make(path)
    line = one_error(*cli(["generate", artifact, "--prompt-file", path], capsys), f"--prompt-file {path}:", *words)
    assert line.count(str(path)) == 1


def test_quantize_of_a_missing_model_dir(tmp_path, capsys):
    one_error(*cli(["quantize", tmp_path / "no-such-model", "-o", tmp_path / "q", "--quant", "int8"], capsys),
              "no-such-model", "does not exist")


def test_output_on_a_read_only_file_system(tiny_dirs, tmp_path, monkeypatch, capsys):
    import tempfile

    out = tmp_path / "art"
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):  # on a read-only mount: EROFS naming the new directory
        if dir is not None and Path(dir) == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, (prefix or "") + "x"))
        return real_mkdtemp(suffix, prefix, dir)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", out, *TINY], capsys),
              f"cannot write {out}", os.strerror(errno.EROFS), "write elsewhere")


def test_output_directory_not_writable_fails_before_compiling(tiny_dirs, tmp_path, monkeypatch, capsys):
    from neuron_infer import oserrors
    from neuron_infer.compile import builder

    monkeypatch.setattr(oserrors.os, "access", lambda path, mode: False)  # as a non-root user would see
    monkeypatch.setattr(builder, "load_checkpoint", lambda *a: pytest.fail("the check must come first"))
    one_error(*cli(["compile", tiny_dirs("gqa"), "-o", tmp_path / "art", *TINY], capsys),
              str(tmp_path), "choose another -o")


def test_user_fixable_os_errors_anywhere_become_one_line(artifact, monkeypatch, capsys):
    from neuron_infer import api

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/some/file")

    monkeypatch.setattr(api, "read_manifest", denied)
    one_error(*cli(["generate", artifact, "--prompt", "hi"], capsys), "/some/file", os.strerror(errno.EACCES))


def test_other_os_errors_keep_their_traceback(artifact, monkeypatch):
    from neuron_infer import api

    def broken(*a, **k):  # an I/O error is not something the user can fix from a message: a real bug report
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/some/file")

    monkeypatch.setattr(api, "read_manifest", broken)
    with pytest.raises(OSError, match="Input/output error"):
        main(["generate", str(artifact), "--prompt", "hi"])


# ---- prompts and sampling ---------------------------------------------------------------------------------------

def test_prompt_that_is_not_utf8(artifact, capsys):
    # how Python hands over the argv bytes b"caf\xff" on POSIX (surrogateescape)
    one_error(*cli(["generate", artifact, "--prompt", os.fsdecode(b"caf\xff")], capsys), "--prompt", "0xff")


def test_prompt_that_is_not_utf8_from_a_real_command_line(artifact):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "neuron_infer.cli", "generate", str(artifact), "--prompt", b"caf\xff"],
                       check=False, capture_output=True, env=env, timeout=300)
    lines = r.stderr.decode(errors="replace").splitlines()
    one_error(r.returncode, lines, "--prompt", "0xff")


@pytest.mark.parametrize("data, words", [(b"ab\xff\xfecd\n", ("not UTF-8", "0xff")),
                                         (b"ab\x00\x00cd\n", ("binary",))])
def test_prompt_file_that_is_not_text(artifact, tmp_path, capsys, data, words):
    (tmp_path / "p.bin").write_bytes(data)
    one_error(*cli(["generate", artifact, "--prompt-file", tmp_path / "p.bin"], capsys), "--prompt-file", *words)


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_non_finite_sampling_flags(artifact, capsys, flag, value):
    one_error(*cli(["generate", artifact, "--prompt", "hi", flag, value], capsys), flag.lstrip("-").replace("-", "_"))


def test_a_kv_cache_larger_than_the_machine_is_a_sizing_error(tiny_dirs, tmp_path):
    """A KV cache larger than the machine is one sizing error before any work, not an allocation failure at load."""
    from neuron_infer.compile.builder import compile_model
    from neuron_infer.config import BuildConfig
    from neuron_infer.errors import ConfigError

    build = BuildConfig(dtype="fp32", batch_size=100000, max_context_length=64, max_length=512)
    with pytest.raises(ConfigError, match=r"--batch-size 100000 x --max-length 512 needs .* GiB to run \(a KV cache of .* GiB"):
        compile_model(tiny_dirs("gqa"), tmp_path / "a", build, backend="cpu-eager", say=lambda m: None)
    assert not (tmp_path / "a").exists()
