"""Hostile input, fuzzed: every field of config.json, generation_config.json, tokenizer_config.json (its chat
template included), manifest.json, the safetensors header and the shard index gets values a broken or malicious
file could hold (nesting 100,000 levels deep, a 5,000-digit integer, NaN, a wrong type, a path outside); every CLI
flag and API parameter gets out-of-range and wrong-typed values. Each case must end with exactly one `error:` line
and exit status 2 (or NeuronInferError from the API), or succeed; never a traceback, never a hang (a case running
past DEADLINE_S fails; no timing is asserted), and nothing outside the command's own output may change.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest

from neuron_infer.artifact.manifest import CHECKSUM, MANIFEST, seal
from neuron_infer.errors import NeuronInferError
from tests.test_user_errors import TINY, cli
from tests.tiny_artifact import compile_tiny, relist

DEADLINE_S = 120  # a hang guard only: real cases take a second or two
MARK = '"@HOSTILE@"'
HOSTILE = {  # JSON text put in place of one value
    "deep": "[" * 100_000 + "]" * 100_000,
    "huge int": "9" * 5_000,
    "nan": "NaN",
    "wrong type": '{"x": [1, "a"]}',
    "negative": "-1",
}
MUST_FAIL = {"deep", "huge int"}  # no field accepts these


@contextlib.contextmanager
def deadline(what):
    def expired(*_):
        raise AssertionError(f"{what}: still running after {DEADLINE_S} s (a hang)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(DEADLINE_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def tree(root: Path) -> dict[str, str]:
    """A fingerprint of everything under root (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = (
                "link" if p.is_symlink() else "dir" if p.is_dir()
                else hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "special")
    return out


def run(args, capsys, what, must_fail: bool, watch: list[Path] = ()) -> int:
    before = [tree(w) for w in watch]
    with deadline(what):
        code, lines = cli(args, capsys)
    assert not any("Traceback" in ln for ln in lines), (what, lines)
    assert code in ((2,) if must_fail else (0, 2)), (what, code, lines)
    if code == 2:
        assert sum(ln.startswith("error: ") for ln in lines) == 1, (what, lines)
    assert [tree(w) for w in watch] == before, f"{what}: changed a file outside its output"
    return code


def with_value(d: dict, key: str, text: str) -> str:
    """d as JSON text with d[key] replaced by raw JSON `text`."""
    return json.dumps({**d, key: "@HOSTILE@"}).replace(MARK, text)


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("hostile") / "a")


@pytest.fixture
def model(tiny_dirs, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), d)
    return d


def compile_args(model: Path, out: Path) -> list:
    return ["compile", model, "-o", out, *TINY]


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_every_checkpoint_json_field(model, tmp_path, capsys, name):
    path = model / name
    base = json.loads(path.read_text()) if path.is_file() else {"eos_token_id": 2}
    out = tmp_path / "out"
    for key in sorted(base):
        for kind, text in HOSTILE.items():
            path.write_text(with_value(base, key, text))
            code = run(compile_args(model, out), capsys, f"{name} {key}={kind}", kind in MUST_FAIL,
                       watch=[model])
            if code == 0:
                shutil.rmtree(out)
    for kind, text in {**HOSTILE, "bom": "\ufeff{}"}.items():  # the whole file
        path.write_text(text)
        run(compile_args(model, out), capsys, f"{name} = {kind}", kind in MUST_FAIL | {"bom", "nan"}, [model])


@pytest.mark.parametrize("kind", ["deep", "huge int", "endless", "huge output", "raise", "syntax"])
def test_tokenizer_config_chat_template(model, tmp_path, capsys, kind):
    template = {"deep": None, "huge int": None, "endless": "{% for i in range(99999) %}{% for j in range(99999) %}"
                "{% endfor %}{% endfor %}", "huge output": "{{ 'x' * 99999 * 99999 }}",
                "raise": "{{ raise_exception('no system role') }}", "syntax": "{% if %}"}[kind]
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(with_value(cfg, "chat_template", HOSTILE[kind]) if template is None
                        else json.dumps({**cfg, "chat_template": template}))
    out = tmp_path / "out"
    if run(compile_args(model, out), capsys, f"chat_template {kind}", template is None, [model]) == 0:
        run(["generate", out, "--chat", "--prompt", "hi", "--max-new-tokens", "1"], capsys,
            f"generate --chat with template {kind}", True, [out])


def test_every_manifest_field(art, tmp_path, capsys):
    root = tmp_path / "a"
    shutil.copytree(art, root)
    base = json.loads((root / MANIFEST).read_text())
    generate = ["generate", root, "--prompt", "hi", "--max-new-tokens", "1"]

    def keys(d, prefix=()):
        for k, v in d.items():
            yield prefix + (k,)
            if isinstance(v, dict) and prefix[:1] != ("files",):
                yield from keys(v, prefix + (k,))

    for key in keys(base):
        for kind, text in HOSTILE.items():
            d = json.loads(json.dumps(base))
            node = d
            for k in key[:-1]:
                node = node[k]
            node[key[-1]] = "@HOSTILE@"
            sealed = d if key == (CHECKSUM,) else seal(d)  # re-sealed: the field itself must be refused
            (root / MANIFEST).write_text(json.dumps(sealed).replace(MARK, text))
            run(generate, capsys, f"manifest {'.'.join(key)}={kind}", True, [root])
            run(["info", root], capsys, f"info: manifest {'.'.join(key)}={kind}", True, [root])
    for entry in ("../../../../etc/hostname", "/proc/self/environ"):
        (root / MANIFEST).write_text(json.dumps(seal({**base, "files": {**base["files"], entry: "0" * 64}})))
        run(generate, capsys, f"manifest files entry {entry}", True, [root])


def safetensors_with_header(path: Path, header_text: str) -> None:
    raw = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)


def test_safetensors_header_and_shard_index(model, tmp_path, capsys):
    single = model / "model.safetensors"
    n = struct.unpack("<Q", single.read_bytes()[:8])[0]
    header = json.loads(single.read_bytes()[8:8 + n])
    first = min(k for k in header if k != "__metadata__")
    out = tmp_path / "out"
    saved = single.read_bytes()
    for key in ("__metadata__", first):
        for kind, text in HOSTILE.items():
            safetensors_with_header(single, with_value(header, key, text))
            run(compile_args(model, out), capsys, f"header {key}={kind}", True, [model])
            run(["quantize", model, "-o", out, "--quant", "int8"], capsys, f"quantize: header {key}={kind}", True,
                [model])
    single.write_bytes(saved)
    # the same weights as a one-shard checkpoint with an index
    shard = "model-00001-of-00001.safetensors"
    single.rename(model / shard)
    index = {"metadata": {"total_size": 1}, "weight_map": {k: shard for k in header if k != "__metadata__"}}
    for key, value in [("weight_map", None)] + [(first, v) for v in ("../model.safetensors", 7, "/etc/hostname")]:
        if value is None:
            texts = {kind: with_value(index, "weight_map", t) for kind, t in HOSTILE.items()}
        else:
            texts = {repr(value): json.dumps({**index, "weight_map": {**index["weight_map"], key: value}})}
        for kind, text in texts.items():
            (model / "model.safetensors.index.json").write_text(text)
            run(compile_args(model, out), capsys, f"index {key}={kind}", True, [model])


GENERATE_FLAGS = {
    "--max-new-tokens": ["0", "-1", "abc", str(2**70)], "--temperature": ["abc", "nan", "-1", "inf"],
    "--top-k": ["-2", "abc"], "--top-p": ["0", "nan", "2"], "--seed": [str(2**70), "-1", "abc"],
    "--min-p": ["nan", "2"], "--repetition-penalty": ["0", "nan"], "--presence-penalty": ["inf", "9"],
    "--frequency-penalty": ["nan"], "--logprobs": ["-1", "abc"], "--threads": ["0", "100000", "abc"],
    "--kv-cache-gib": ["nan", "inf", "1e6", "0", "-1"], "--prefill-chunk": ["-1", "abc"],
    "--prompt-file": ["/dev/zero", "/nonexistent", "/"], "--stop": [""],
    "--expect-digest": ["abc", "", "0" * 64, "0" * 65],
}


def test_every_generate_and_chat_flag(art, model, tmp_path, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # chat: no message
    for flag, values in GENERATE_FLAGS.items():
        for value in values:
            args = ["generate", art, "--json", flag, value]
            if flag != "--prompt-file":
                args += ["--prompt", "hi"]
            if flag not in ("--max-new-tokens", "--logprobs"):
                args += ["--max-new-tokens", "1"]
            run(args, capsys, f"generate {flag} {value}", True, [art])
            if flag in ("--temperature", "--top-k", "--seed", "--threads", "--max-new-tokens", "--expect-digest"):
                huge = value == str(2**70)  # an answer length beyond max_length: allowed (answers stop there)
                run(["chat", art, flag, value], capsys, f"chat {flag} {value}", not huge, [art])
    for flag, value in [("--kv-block-size", "0"), ("--context-buckets", "a,b"), ("--quant", "int3"),
                        ("--batch-size", "0"), ("--max-length", "-5"), ("--tp-degree", "0"),
                        ("--batch-size", str(2**31)), ("--batch-size", str(2**63)), ("--max-length", str(10**12)),
                        ("--tokengen-batch-buckets", str(2**62))]:
        out = tmp_path / "out"
        run(["compile", model, "-o", out, *TINY, flag, value], capsys, f"compile {flag} {value}", True, [model])
    for args in (["-o", "/"], ["-o", "/proc/x"]):
        run(["compile", model, *args, *TINY], capsys, f"compile {args}", True, [model])


def cli_out(args, capsys) -> tuple[int, str]:
    with deadline(" ".join(map(str, args))), pytest.raises(SystemExit) as e:
        from neuron_infer.cli import main

        main([str(a) for a in args])
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().out


def test_prompt_files_split_only_at_newlines(art, tmp_path, capsys):
    p = tmp_path / "prompts.txt"
    p.write_text("one\x0cstill one\x1e\x85\u2028\rend\r\ntwo\n")
    code, out = cli_out(["generate", art, "--prompt-file", p, "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["outputs"]) == 2, out


API_LOAD = {"kv_cache_gib": [math.nan, math.inf, 1e9, -1, "1"], "threads": [0, 10**6, 1.5, "x"],
            "prefill_chunk": [-1, 1.5], "expect_digest": [123, "abc", "0" * 64]}
API_GENERATE = {"prompts": ["abc", [None], [1], None], "max_new_tokens": [0, 2.5, "3", True],
                "stop": ["ab", [1], [""]], "logprobs": [-1, 1.5]}
API_GENERATE_IDS = {"prompts": [[[1.0, 2.0]], [["a"]], [[10**9]], "abc"], "max_new_tokens": [2.5]}


def test_every_api_parameter(art):
    from neuron_infer.api import CompiledModel

    for name, values in API_LOAD.items():
        for value in values:
            with deadline(f"load {name}={value!r}"), pytest.raises(NeuronInferError):
                CompiledModel.load(art, **{name: value})
    m = CompiledModel.load(art)
    for name, values in API_GENERATE.items():
        for value in values:
            kw = {"prompts": ["hi"], "max_new_tokens": 1, name: value}
            with deadline(f"generate {name}={value!r}"), pytest.raises(NeuronInferError):
                m.generate(**kw)
    for name, values in API_GENERATE_IDS.items():
        for value in values:
            kw = {"prompts": [[1, 2]], "max_new_tokens": 1, name: value}
            with deadline(f"generate_ids {name}={value!r}"), pytest.raises(NeuronInferError):
                m.generate_ids(**kw)


SAMPLING = {"top_k": [2.5, "3", True], "seed": [1.5, True, "7"], "top_p": ["0.5"], "temperature": ["1", None],
            "min_tokens": [1.5], "repetition_penalty": ["2"]}
API_OTHER = {"sampling": [None, {"temperature": 0.0}], "chat": ["yes", 1], "ignore_eos": [1], "on_tokens": [5]}
MESSAGES = ["hi", [], ["hi"], [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": 5, "content": "x"}]]


def test_api_types_beyond_the_prompts(art):
    """Wrong types a Python caller can pass: a NeuronInferError naming the parameter, never a TypeError or
    AttributeError from deep inside, and never a silently accepted 2.5 or True (a conversation given as a string
    was rendered character by character)."""
    import numpy as np

    from neuron_infer.api import CompiledModel
    from neuron_infer.config import SamplingConfig

    for name, values in SAMPLING.items():
        for value in values:
            with pytest.raises(NeuronInferError, match=name):
                SamplingConfig(**{name: value})
    assert SamplingConfig(top_k=np.int64(3), temperature=np.float32(0.5)).top_k == 3  # NumPy numbers: converted
    for bad in (5, None, ["a"]):
        with pytest.raises(NeuronInferError, match="artifact_dir"):
            CompiledModel.load(bad)
    m = CompiledModel.load(art)
    for name, values in API_OTHER.items():
        for value in values:
            with deadline(f"generate {name}={value!r}"), pytest.raises(NeuronInferError, match=name):
                m.generate(["hi"], max_new_tokens=1, **{name: value})
    for messages in MESSAGES:
        with deadline(f"generate_chat {messages!r}"), pytest.raises(NeuronInferError, match="messages"):
            m.generate_chat(messages, max_new_tokens=1)


def test_json_logprobs_output_is_valid_json(art, capsys, monkeypatch):
    from neuron_infer import api

    real = api.CompiledModel._text

    def nan_logprobs(self, r, rule):
        out = real(self, r, rule)
        for e in out.logprobs or []:
            e["logprob"] = math.nan
        return out

    monkeypatch.setattr(api.CompiledModel, "_text", nan_logprobs)
    code, out = cli_out(["generate", art, "--prompt", "hi", "--max-new-tokens", "2", "--json", "--logprobs", "1"],
                        capsys)
    assert code == 0
    record = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert record["outputs"][0]["logprobs"][0]["logprob"] is None


def test_a_hostile_artifact_template_never_runs_unverified(art, tmp_path, capsys):
    root = tmp_path / "a"
    shutil.copytree(art, root)
    (root / "tokenizer" / "chat_template.jinja").write_text("{% for i in range(99999) %}{% for j in range(99999) %}"
                                                           "{% endfor %}{% endfor %}")
    run(["generate", root, "--chat", "--prompt", "hi"], capsys, "tampered template", True, [root])
    relist(root)  # now listed and verified: the limits stop it
    run(["generate", root, "--chat", "--prompt", "hi"], capsys, "hostile template", True, [root])
    run(["chat", root], capsys, "chat with a hostile template", True, [root])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(model, tmp_path, capsys, bad):
    from safetensors.torch import load_file, save_file

    state = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    state[name].view(-1)[3] = bad
    save_file(state, model / "model.safetensors")
    out = tmp_path / "out"
    for args in (compile_args(model, out), ["quantize", model, "-o", out, "--quant", "int8"]):
        code, lines = cli(args, capsys)
        errors = [ln for ln in lines if ln.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and name in errors[0] and "NaN or infinite" in errors[0], lines
        assert not out.exists()


@pytest.mark.parametrize("output", ["text", "json"])
@pytest.mark.parametrize("stdout", ["closed", "broken pipe"])
def test_a_closed_or_broken_stdout_ends_quietly(art, stdout, output):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "neuron_infer.cli", "generate", str(art), "--prompt", "hi", "--max-new-tokens", "4",
           *(["--json"] if output == "json" else [])]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if stdout == "closed":
        p = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=DEADLINE_S, env=env,
                           preexec_fn=lambda: os.close(1))
    else:
        read, write = os.pipe()
        os.close(read)  # nobody reads: the first write gets EPIPE
        p = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=DEADLINE_S, env=env)
        os.close(write)
    assert "Traceback" not in p.stderr and "error" not in p.stderr.lower(), p.stderr
    assert p.returncode in (0, 1), (p.returncode, p.stderr)
