"""Hostile input that passes the hashes: an artifact whose manifest fields or files were rewritten consistently
(the manifest's checksum and file hashes rewritten to match, which only catch damage), the tokenizer files of a
checkpoint changed while it compiles, and prompt files, flags and API values at their edges. Each case ends in one
`error:` line (exit status 2) naming what is wrong, or succeeds with a correct result; never a traceback, a hang
(a case running past DEADLINE_S fails; no timing is asserted) or a silently wrong answer.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from neuron_infer.artifact.manifest import MANIFEST, seal
from neuron_infer.config import BuildConfig, QuantConfig
from neuron_infer.errors import NeuronInferError
from tests.test_fuzz_hostile import DEADLINE_S, cli_out, deadline, run
from tests.test_user_errors import TINY, cli, one_error
from tests.tiny_artifact import compile_tiny, relist, rewrite_weights

SMALL = {"max_context_length": 64, "max_length": 96, "context_buckets": (64,), "tokengen_buckets": (96,)}


@pytest.fixture(scope="module")
def arts(tiny_dirs, tmp_path_factory):
    """name -> a tiny eager artifact: fp32, int8 (fp32), fp8 on every linear (bf16), and a tied-head fp32 one."""
    root = tmp_path_factory.mktemp("rewritten")
    builds = {"fp32": None, "int8": BuildConfig(dtype="fp32", quant=QuantConfig(scheme="int8"), **SMALL),
              "fp8": BuildConfig(dtype="bf16", quant=QuantConfig(scheme="fp8", modules_to_not_convert=()), **SMALL),
              "tied": BuildConfig(dtype="fp32", **SMALL)}
    out = {}
    for name, build in builds.items():
        src = tiny_dirs("tied" if name == "tied" else "gqa")
        out[name] = compile_tiny(src, root / name) if build is None else compile_tiny(src, root / name, build)
    return out


def generate(root: Path) -> list:
    return ["generate", root, "--prompt", "hi", "--max-new-tokens", "2"]


def copy_of(arts, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(arts[name], dst)
    return dst


def resealed(root: Path, path: tuple, value) -> Path:
    m = json.loads((root / MANIFEST).read_text())
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    (root / MANIFEST).write_text(json.dumps(seal(m)))
    return root


# (artifact, manifest key path, value, words of the error): every one was loaded (or run) before these checks
MANIFEST_REWRITES = [
    ("fp32", ("build", "dtype"), "bf16", ["lm_head.weight", "torch.float32", "torch.bfloat16"]),
    ("fp32", ("build", "quant", "scheme"), "int8", ["missing tensor", "weight_scale"]),
    ("int8", ("build", "quant", "scheme"), "none", ["unexpected tensor", "weight_scale"]),
    ("fp32", ("model", "tie_word_embeddings"), True, ["unexpected tensor", "lm_head.weight"]),  # head replaced
    ("tied", ("model", "tie_word_embeddings"), False, ["missing tensor", "lm_head.weight"]),
    ("fp32", ("model", "attention_bias"), True, ["missing tensor", "self_attn"]),
    ("fp32", ("model", "mlp_bias"), True, ["missing tensor", "mlp"]),
    ("fp32", ("model", "num_kv_heads"), 1, ["k_proj.weight", "shape"]),
    ("fp32", ("model", "head_dim"), 12, ["shape"]),
    ("fp32", ("model", "num_heads"), 8, ["shape"]),
    ("fp32", ("model", "vocab_size"), 256, ["vocab_size=256"]),
    ("fp32", ("model", "max_position_embeddings"), 10, ["max_position_embeddings=10", "max_length"]),
    ("fp32", ("model", "eos_token_ids"), [10**6], ["eos_token_ids", "0..511"]),  # EOS never emitted: no stop
    ("fp32", ("model", "bos_token_id"), 10**6, ["bos_token_id", "0..511"]),
]


@pytest.mark.parametrize("art, key, value, words", MANIFEST_REWRITES,
                         ids=[f"{a}:{'.'.join(k)}={v}" for a, k, v, _ in MANIFEST_REWRITES])
def test_a_rewritten_manifest_field(arts, tmp_path, capsys, art, key, value, words):
    root = resealed(copy_of(arts, art, tmp_path), key, value)
    with deadline(f"{key}={value}"):
        one_error(*cli(generate(root), capsys), *words)
        with pytest.raises(NeuronInferError):
            from neuron_infer.api import CompiledModel

            CompiledModel.load(root)


def test_a_graph_entry_naming_another_graph(arts, tmp_path, capsys):
    root = copy_of(arts, "fp32", tmp_path)
    m = json.loads((root / MANIFEST).read_text())
    name = min(m["graphs"])
    m["graphs"][name]["graph"] = max(m["graphs"])  # a graph of other shapes
    (root / MANIFEST).write_text(json.dumps(seal(m)))
    one_error(*cli(generate(root), capsys), f"graphs.{name}.graph", "recompile")


def first(state: dict, test) -> str:
    return next(k for k in sorted(state) if test(k, state[k]))


def _int8_as_fp32(s):
    k = first(s, lambda _k, t: t.dtype == torch.int8)
    s[k] = s[k].float()


def _scale_as_fp16(s):
    k = first(s, lambda k, t: "scale" in k and t.dtype.is_floating_point)
    s[k] = s[k].half()


def _nan_scale(s):
    s[first(s, lambda k, t: "scale" in k and t.dtype.is_floating_point)].view(-1)[0] = math.nan


def _fp8_nan(s):  # 0x7F: the NaN of float8_e4m3fn (it has no infinity)
    s[first(s, lambda _k, t: t.dtype == torch.float8_e4m3fn)].view(torch.uint8).view(-1)[0] = 0x7F


def _bf16_as_fp32(s):
    s.update({k: t.float() for k, t in s.items() if t.dtype == torch.bfloat16})


WEIGHT_REWRITES = [("int8", _int8_as_fp32, ["is stored as torch.float32", "torch.int8"]),
                   ("int8", _scale_as_fp16, ["weight_scale", "torch.float16"]),
                   ("int8", _nan_scale, ["weight_scale", "NaN or infinite"]),
                   ("fp8", _fp8_nan, ["NaN or infinite"]),
                   ("fp8", _bf16_as_fp32, ["is stored as torch.float32", "torch.bfloat16"])]


@pytest.mark.parametrize("art, edit, words", WEIGHT_REWRITES, ids=[f"{a}:{e.__name__}" for a, e, _ in WEIGHT_REWRITES])
def test_rewritten_weights_of_a_quantized_artifact(arts, tmp_path, capsys, art, edit, words):
    root = rewrite_weights(copy_of(arts, art, tmp_path), edit)
    run(generate(root), capsys, edit.__name__, True, [root])
    one_error(*cli(generate(root), capsys), *words)


def _raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _shared_bytes(path: Path) -> None:
    header, data = _raw_header(path)
    a, b = [k for k in sorted(header) if header[k]["shape"] == header["model.layers.0.mlp.up_proj.weight"]["shape"]][:2]
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write_header(path, header, data)


def _metadata_number(path: Path) -> None:
    header, data = _raw_header(path)
    _write_header(path, {**header, "__metadata__": {"format": 5}}, data)


FILE_REWRITES = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "two tensors share bytes": _shared_bytes,
    "metadata value not a string": _metadata_number,
}


@pytest.mark.parametrize("kind", FILE_REWRITES)
def test_a_rewritten_weights_file(arts, tmp_path, capsys, kind):
    root = copy_of(arts, "fp32", tmp_path)
    FILE_REWRITES[kind](root / "weights" / "rank0.safetensors")
    relist(root)
    run(generate(root), capsys, f"weights file {kind}", True, [root])


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_weights_file_that_is_not_a_file(arts, tmp_path, capsys, kind):
    root = copy_of(arts, "fp32", tmp_path)
    path = root / "weights" / "rank0.safetensors"
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    run(generate(root), capsys, f"weights file is a {kind}", True, [root])


def test_an_artifact_tokenizer_with_ids_past_the_vocabulary(arts, tmp_path, capsys):
    """A prompt holding such an id would index past the embedding: refused when the tokenizer is loaded."""
    root = copy_of(arts, "fp32", tmp_path)
    path = root / "tokenizer" / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["vocab"]["zzhigh"] = 5000
    path.write_text(json.dumps(tok))
    relist(root)
    one_error(*cli(generate(root), capsys), "token ids up to 5000", "vocab_size=512")


def test_a_config_eos_id_past_the_vocabulary_is_refused_at_compile(tiny_dirs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 512}))
    one_error(*cli(["compile", model, "-o", tmp_path / "out", *TINY], capsys), "eos_token_ids=(512,)", "0..511")
    assert not (tmp_path / "out").exists()


# ---- the tokenizer files a compile copies ------------------------------------------------------------------------

def test_the_tokenizer_files_checked_are_the_ones_copied(tiny_dirs, tmp_path, monkeypatch):
    """A checkpoint file changed right after the check never reaches the artifact: the artifact holds the bytes
    that were checked, and loads."""
    from neuron_infer.api import CompiledModel
    from neuron_infer.compile import builder

    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    real, checked = builder.check_tokenizer, {}

    def check_then_swap(directory, *args, **kwargs):
        real(directory, *args, **kwargs)
        checked.update({p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()})
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))  # out of range

    monkeypatch.setattr(builder, "check_tokenizer", check_then_swap)
    out = compile_tiny(model, tmp_path / "out")
    assert (out / "tokenizer" / "generation_config.json").read_bytes() == checked["generation_config.json"]
    CompiledModel.load(out)


def test_a_bad_checkpoint_tokenizer_file_is_named_by_its_checkpoint_path(tiny_dirs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    line = one_error(*cli(["compile", model, "-o", tmp_path / "out", *TINY], capsys),
                     str(model / "generation_config.json"), "eos_token_id")
    assert ".partial" not in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


# ---- prompt files: a named pipe, a device, a socket, stdin by name ------------------------------------------------

def test_a_prompt_fifo_nobody_writes_to_is_an_error_not_a_hang(arts, tmp_path, capsys, monkeypatch):
    from neuron_infer import text_input

    monkeypatch.setattr(text_input, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    with deadline("--prompt-file FIFO without a writer"):
        one_error(*cli(["generate", arts["fp32"], "--prompt-file", fifo], capsys), str(fifo), "named pipe")


def test_a_prompt_fifo_with_a_writer_is_read(arts, tmp_path, capsys):
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:  # blocks until the reader has opened it
            f.write("one\ntwo\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    code, out = cli_out(["generate", arts["fp32"], "--prompt-file", fifo, "--max-new-tokens", "1", "--json"], capsys)
    writer.join(DEADLINE_S)
    assert code == 0 and len(json.loads(out)["outputs"]) == 2, out


def test_prompt_files_that_are_not_text_files(arts, tmp_path, capsys):
    sock_path = tmp_path / "s"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        for path, kind in (("/dev/zero", "character device"), (sock_path, "cannot read it"), (tmp_path, "directory")):
            with deadline(f"--prompt-file {path}"):
                one_error(*cli(["generate", arts["fp32"], "--prompt-file", path], capsys), str(path), kind)
    finally:
        sock.close()


def test_prompt_file_dev_stdin_reads_a_piped_batch(arts):
    cmd = [sys.executable, "-m", "neuron_infer.cli", "generate", str(arts["fp32"]), "--prompt-file", "/dev/stdin",
           "--max-new-tokens", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    p = subprocess.run(cmd, check=False, input="one\ntwo\nthree\n", capture_output=True, text=True, timeout=DEADLINE_S, env=env)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["outputs"]) == 3


# ---- flags and API values at their edges ------------------------------------------------------------------------

EDGE_FLAGS = [(["--stop", "x" * 2_000_000, "--max-new-tokens", "8", "--ignore-eos"], 0), (["--stop", "\U0001F600" * 1000], 0), (["--top-k", str(10**12)], 0),
              (["--prefill-chunk", str(10**12)], 0), (["--temperature", "1e-300"], 0),
              (["--repetition-penalty", "1e300"], 0), (["--seed", str(2**63)], 2), (["--kv-cache-gib", "1e-12"], 2),
              (["--logit-bias", "5:nan"], 2), (["--logit-bias", f"{10**9}:1"], 2), (["--min-tokens", str(10**12)], 0),
              (["--json-schema", "[" * 10_000 + "]" * 10_000], 2)]


@pytest.mark.parametrize("flags, code", EDGE_FLAGS, ids=[f"{f[0]} {f[1][:12]}" for f, _ in EDGE_FLAGS])
def test_generate_flags_at_their_edges(arts, capsys, flags, code):
    """Accepted values run to the end (a stop string of 2 M characters took seconds per token to hold back the
    text that might start it, quadratic in its length); the rest are one error line."""
    got = run([*generate(arts["fp32"]), *flags], capsys, " ".join(flags)[:40], code == 2, [arts["fp32"]])
    assert got == code


def test_api_values_at_their_edges(arts):
    import numpy as np

    from neuron_infer.api import CompiledModel
    from neuron_infer.config import SamplingConfig

    m = CompiledModel.load(arts["fp32"])
    bad = [lambda: m.generate_ids([[True, 1]], 1), lambda: m.generate_ids([[np.int64(1)]], 1),
           lambda: m.generate(["hi"], 1, stop=[None]), lambda: m.generate(["hi"], 1, sampling=SamplingConfig(
               logit_bias={1: math.nan})), lambda: CompiledModel.load(arts["fp32"], prefill_chunk=True)]
    for i, call in enumerate(bad):
        with deadline(f"API case {i}"), pytest.raises(NeuronInferError):
            call()
    out = m.generate(["hi"], 10**12, stop=("a",) * 10_000)  # stops at max_length; many stop strings are fine
    assert len(out.outputs) == 1
