"""Bad input: each case exits non-zero with one `error:` line naming the file/field and the fix; nothing half-written."""
import json
import shutil

import pytest

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.artifact.manifest import MANIFEST, seal
from neuron_infer.cli import main
from neuron_infer.config import BuildConfig
from neuron_infer.errors import ArtifactError

TINY = ["--config", "tiny", "--backend", "cpu-eager"]


def run_cli(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
        raise SystemExit(0)
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, (err[-1] if err else "")


def fresh_copy(tiny_dirs, tmp_path, preset="gqa"):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dirs(preset), dst)
    return dst


def compile_fails(model_dir, tmp_path, capsys):
    out = tmp_path / "art"
    code, msg = run_cli(["compile", str(model_dir), "-o", str(out), *TINY], capsys)
    assert code == 2 and msg.startswith("error: ")
    assert not out.exists() and not list(tmp_path.glob(".art.partial-*")), "nothing half-written"
    return msg


def test_missing_config_json(tiny_dirs, tmp_path, capsys):
    d = fresh_copy(tiny_dirs, tmp_path)
    (d / "config.json").unlink()
    assert "config.json not found" in compile_fails(d, tmp_path, capsys)


def test_missing_safetensors(tiny_dirs, tmp_path, capsys):
    d = fresh_copy(tiny_dirs, tmp_path)
    (d / "model.safetensors").unlink()
    assert "safetensors" in compile_fails(d, tmp_path, capsys)


def test_truncated_safetensors(tiny_dirs, tmp_path, capsys):
    d = fresh_copy(tiny_dirs, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = compile_fails(d, tmp_path, capsys)
    assert "model.safetensors" in msg and "re-download" in msg


def test_tensor_shape_mismatch(tiny_dirs, tmp_path, capsys):
    d = fresh_copy(tiny_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    assert "mlp" in compile_fails(d, tmp_path, capsys) or "shape" in compile_fails(d, tmp_path, capsys)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"frobnicate": True}, "unknown config key"),
])
def test_config_problems(tiny_dirs, tmp_path, capsys, change, words):
    d = fresh_copy(tiny_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    assert words in compile_fails(d, tmp_path, capsys)


def test_pickle_checkpoint_is_refused(tiny_dirs, tmp_path, capsys):
    d = fresh_copy(tiny_dirs, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    msg = compile_fails(d, tmp_path, capsys)
    assert "pytorch_model.bin" in msg and "safetensors" in msg


@pytest.fixture
def artifact(tiny_dirs, tmp_path):
    out = tmp_path / "art"
    compile_model(tiny_dirs("gqa"), out, BuildConfig.from_dict(json.load(open("configs/tiny.json"))["build"]),
                  backend="cpu-eager", say=lambda m: None)
    return out


def _edit_manifest(root, fn):
    m = json.loads((root / MANIFEST).read_text())
    fn(m)
    (root / MANIFEST).write_text(json.dumps(seal(m)))


def test_other_format_version(artifact, capsys):
    _edit_manifest(artifact, lambda m: m.update(format_version=99))
    code, msg = run_cli(["generate", str(artifact), "--prompt", "hi"], capsys)
    assert code == 2 and "format_version=99" in msg and "recompile" in msg


def test_other_torch_version(artifact, capsys):
    _edit_manifest(artifact, lambda m: m["versions"].update(torch="1.0.0"))
    code, msg = run_cli(["generate", str(artifact), "--prompt", "hi"], capsys)
    assert code == 2 and "versions.torch='1.0.0'" in msg


def test_checkpoint_fingerprint_mismatch(artifact, tiny_dirs):
    with pytest.raises(ArtifactError, match="checkpoint_fingerprint"):
        CompiledModel.load(artifact, expect_checkpoint=tiny_dirs("mha"))
    CompiledModel.load(artifact, expect_checkpoint=tiny_dirs("gqa"))  # the right checkpoint loads


def test_corrupted_weights_or_graph_file(artifact, capsys):
    w = artifact / "weights" / "rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    code, msg = run_cli(["generate", str(artifact), "--prompt", "hi"], capsys)
    assert code == 2 and "rank0.safetensors is corrupted" in msg


def test_interrupted_compile_leaves_nothing_that_loads(tiny_dirs, tmp_path, monkeypatch, capsys):
    import neuron_infer.compile.builder as builder

    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C in the middle of compiling graphs

    monkeypatch.setattr(builder, "compile_graphs", boom)
    with pytest.raises(KeyboardInterrupt):
        compile_model(tiny_dirs("gqa"), tmp_path / "art", BuildConfig(dtype="fp32", max_context_length=32,
                      max_length=64), backend="cpu-eager", say=lambda m: None)
    assert calls and not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.*"))


def test_directory_without_manifest_explains_itself(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "weights").mkdir()
    code, msg = run_cli(["generate", str(tmp_path / "half"), "--prompt", "x"], capsys)
    assert code == 2 and "manifest.json not found" in msg and "interrupted compile" in msg


def test_existing_output_is_not_clobbered(artifact, tiny_dirs, capsys):
    code, msg = run_cli(["compile", str(tiny_dirs("gqa")), "-o", str(artifact), *TINY], capsys)
    assert code == 2 and "--overwrite" in msg
    assert (artifact / MANIFEST).is_file()


def test_build_flags_with_an_artifact_are_rejected(artifact, capsys):
    code, msg = run_cli(["generate", str(artifact), "--dtype", "bf16"], capsys)
    assert code == 2 and "apply when compiling" in msg
