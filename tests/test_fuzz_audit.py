"""More variants of hostile input, on the paths and files a user names: a symbolic link that loops, a name that is not
UTF-8 (a byte a Linux file name may hold, given on the command line), a NUL character or an empty path from the Python
API, a --json-schema file that is a named pipe nobody writes to. Each is one `error:` line naming the argument (exit
status 2) or a NeuronInferError, never a traceback, a hang or a message blaming a sound file, and nothing changes."""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from neuron_infer.errors import NeuronInferError
from tests.test_fuzz_hostile import deadline, tree  # deadline: a hang guard only, no timing asserted
from tests.test_user_errors import TINY, cli, one_error
from tests.tiny_artifact import CLI_BUILD, compile_tiny

GENERATE = ["--prompt", "hi", "--max-new-tokens", "1"]


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("audit") / "a")


def path_commands(p: str, model: Path, art: Path, out: Path) -> dict[str, list]:
    """Every command line that takes a path, with `p` as that path: {argument name: argv}."""
    return {
        "MODEL_DIR": ["compile", p, "-o", out, *TINY],
        "-o": ["compile", model, "-o", p, *TINY],
        "quantize MODEL_DIR": ["quantize", p, "-o", out, "--quant", "int8"],
        "quantize -o": ["quantize", model, "-o", p, "--quant", "int8"],
        "ARTIFACTS": ["generate", p, *GENERATE],
        "chat ARTIFACTS": ["chat", p],
        "info ARTIFACTS": ["info", p],
        "--prompt-file": ["generate", art, "--prompt-file", p, "--max-new-tokens", "1"],
        "--draft-model": ["compile", model, "-o", out, *TINY, "--draft-model", p, "--speculation-length", "2"],
        "--json-schema": ["generate", art, *GENERATE, "--json-schema", p],
    }


@pytest.mark.parametrize("kind", ["link loop", "under a link loop", "not UTF-8", "not UTF-8 inside"])
def test_paths_that_cannot_be_opened_are_named(tiny_dirs, art, tmp_path, capsys, kind):
    """A link loop gave a RuntimeError traceback (-o, --draft-model); a name holding byte 0xff (decoded by Python as
    U+DCFF) was reported as a corrupt safetensors file ("re-download it"), a broken tokenizer or an artifact to
    recompile, and was a traceback in `quantize`."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    odd = tmp_path / "odd\udcffdir"  # a real directory whose name is not UTF-8
    shutil.copytree(art, odd)
    p = {"link loop": str(loop), "under a link loop": str(loop / "x"), "not UTF-8": "\udcff",
         "not UTF-8 inside": str(odd)}[kind]
    words = ("loop",) if "loop" in kind else ("not a UTF-8 path", "byte 0xff", "rename")
    model, out = tiny_dirs("gqa"), tmp_path / "out"
    before = tree(tmp_path), tree(model), tree(art)
    for name, args in path_commands(p, model, art, out).items():
        with deadline(f"{name} {kind}"):
            error = one_error(*cli(args, capsys), *words)
        assert error.startswith(f"error: {name.split()[-1]} "), (name, error)
    assert (tree(tmp_path), tree(model), tree(art)) == before


def test_api_paths_that_cannot_be_opened(tiny_dirs, tmp_path):
    from neuron_infer.api import CompiledModel, compile_model

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    model = tiny_dirs("gqa")
    for bad in (str(loop), loop / "x", "a\0b", "\udcff", "", b"/tmp"):
        for name, call, args in (("artifact_dir", CompiledModel.load, (bad,)),
                                 ("model_dir", compile_model, (bad, tmp_path / "o", CLI_BUILD)),
                                 ("out_dir", compile_model, (model, bad, CLI_BUILD))):
            with deadline(f"{name}={bad!r}"), pytest.raises(NeuronInferError, match=name):
                call(*args)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_json_schema_that_is_not_a_text_file(art, tmp_path, capsys, monkeypatch, kind):
    """--json-schema was read whole with no bound: /dev/zero filled the memory, and a named pipe nobody writes to
    hung forever. It is read like --prompt-file: bounded, without blocking, and a device is refused."""
    from neuron_infer import text_input

    monkeypatch.setattr(text_input, "PIPE_WAIT_S", 0.5)
    p = tmp_path / "schema.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(p))
    with deadline(f"--json-schema {kind}"):
        one_error(*cli(["generate", art, *GENERATE, "--json-schema", p], capsys), "--json-schema",
                  {"fifo": "FIFO", "directory": "directory", "socket": "socket"}[kind])


def _cache_with_user_files(cache: Path, art: Path) -> dict[str, Path]:
    """A cache whose model, artifact and graph entries (stale: built by other versions) each hold a user's file."""
    import json

    entries = {"artifact": cache / "artifacts" / "smollm2-135m-0123456789abcdef",
               "graph": cache / "graphs" / ("a" * 32), "model": cache / "models" / "SmolLM2-135M-Instruct-0123456789abcdef"}
    shutil.copytree(art, entries["artifact"])
    manifest = json.loads((entries["artifact"] / "manifest.json").read_text())
    manifest["versions"]["neuron_infer"] = "0.0.1"
    (entries["artifact"] / "manifest.json").write_text(json.dumps(manifest))
    entries["graph"].mkdir(parents=True)
    (entries["graph"] / "g.pt2").write_text("graph")
    (entries["graph"] / "neuron_infer_graph.json").write_text(json.dumps({"files": ["g.pt2"],
                                                                          "versions": {"torch": "0"}}))
    entries["model"].mkdir(parents=True)
    (entries["model"] / "config.json").write_text("{}")
    (entries["model"] / "neuron_infer_source.json").write_text(json.dumps({"gguf_sha256": "0123456789abcdef" * 4}))
    for p in entries.values():
        (p / "my-notes.txt").write_text("mine")
    return entries


def test_cache_prune_keeps_an_entry_holding_user_files(art, tmp_path, capsys, monkeypatch):
    """`cache prune --all` deleted the whole directory of a recognised entry, user files inside included. An entry
    holding anything neuron-infer did not write is kept and named with what is in the way; once the file is moved
    out, the entry is pruned."""
    cache = tmp_path / "cache"
    entries = _cache_with_user_files(cache, art)
    monkeypatch.setenv("NEURON_INFER_CACHE", str(cache))
    before = tree(cache)
    for args in (["cache", "prune"], ["cache", "prune", "--all"]):
        code, out = cli_out(args, capsys)
        assert code == 0 and tree(cache) == before, out
        for p in entries.values():
            assert f"kept {p}: holds my-notes.txt, which neuron-infer did not write" in out, out
    code, listed = cli_out(["cache", "list"], capsys)
    for p in entries.values():
        assert f"{p.relative_to(cache)}  (holds my-notes.txt" in listed, listed
    for p in entries.values():
        (p / "my-notes.txt").unlink()
    code, out = cli_out(["cache", "prune", "--all"], capsys)
    assert code == 0 and not any(p.exists() for p in entries.values()), out


def cli_out(args: list, capsys) -> tuple[int, str]:
    """Run the CLI in this process: (exit status, stdout)."""
    from neuron_infer.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().out


def test_prompt_from_a_closed_stdin(art, capsys, monkeypatch):
    """`--prompt -` with stdin closed (`0<&-`: sys.stdin is None) was an AttributeError traceback."""
    import sys

    monkeypatch.setattr(sys, "stdin", None)
    one_error(*cli(["generate", art, "--prompt", "-", "--max-new-tokens", "1"], capsys), "stdin is closed")


def test_chat_text_too_long_to_fit_is_refused_before_it_is_tokenized(art, capsys, monkeypatch):
    """A chat message or --system text longer than 64 characters per token of max_context_length was tokenized
    whole first (a message of 6 M characters became 6 M tokens before the length check)."""
    import io
    import sys

    from neuron_infer import api

    calls = []
    real = api.encode_chat
    monkeypatch.setattr(api, "encode_chat", lambda tok, msgs, *a, **k: calls.append(
        max(len(m["content"]) for m in msgs)) or real(tok, msgs, *a, **k))
    long = "hi " * 10_000  # 30,000 characters: more than 64 x max_context_length (256)
    one_error(*cli(["chat", art, "--system", long], capsys), "--system has 30000 characters", "cannot fit")
    monkeypatch.setattr(sys, "stdin", io.StringIO(long + "\nhi\n"))
    code, lines = cli(["chat", art, "--max-new-tokens", "1"], capsys)
    assert code == 0 and any("this message has 30000 characters" in ln for ln in lines), lines
    assert max(calls) < 30_000


def test_api_values_past_their_types(art):
    """Python values the type checks let through: an int too large for a float (10**400) raised OverflowError, a
    lone surrogate in a chat message a TypeError from the tokenizer, a non-callable on_stage or a non-tokenizer
    tokenizer a TypeError or AttributeError. Each is a NeuronInferError naming the parameter."""
    from neuron_infer.api import CompiledModel
    from neuron_infer.config import SamplingConfig

    for name in ("temperature", "repetition_penalty", "top_p", "min_p", "presence_penalty"):
        with pytest.raises(NeuronInferError, match=name):
            SamplingConfig(**{name: 10**400})
    for kw in ({"kv_cache_gib": 10**400}, {"on_stage": 5}, {"tokenizer": 5}, {"tokenizer": "x"}):
        with deadline(f"load {kw}"), pytest.raises(NeuronInferError, match=next(iter(kw)).replace("_", "[_-]")):
            CompiledModel.load(art, **kw)
    m = CompiledModel.load(art)
    for messages in ([{"role": "user", "content": "\ud800"}], [{"role": "\udcff", "content": "x"}]):
        with deadline(f"generate_chat {messages!r}"), pytest.raises(NeuronInferError, match=r"messages\[0\]"):
            m.generate_chat(messages, max_new_tokens=1)


@pytest.mark.parametrize("kind", ["json not UTF-8", "text not UTF-8", "many entries", "distinct entries"])
def test_a_modules_to_not_convert_file(tiny_dirs, tmp_path, capsys, kind):
    """A --modules-to-not-convert file that is not UTF-8 was a UnicodeDecodeError traceback; one of 3 M lines ran
    for minutes (every entry matched against every layer). Repeats are dropped; too many distinct names is one
    error; a file read is bounded like --prompt-file."""
    path = tmp_path / ("mods.json" if kind.startswith("json") else "mods.txt")
    path.write_bytes({"json not UTF-8": b'["\xff"]', "text not UTF-8": b"lm_head\n\xff\n",
                      "many entries": b"lm_head\n" * 1_000_000,
                      "distinct entries": b"".join(b"m%d\n" % i for i in range(70_000))}[kind])
    model, out = tiny_dirs("gqa"), tmp_path / "out"
    before = tree(model)
    for args in (["compile", model, "-o", out, *TINY], ["quantize", model, "-o", out]):
        with deadline(f"{args[0]} {kind}"):
            code, lines = cli([*args, "--quant", "int8", "--modules-to-not-convert", path], capsys)
        if kind == "many entries":
            assert code == 0, lines
            shutil.rmtree(out)
        else:
            one_error(code, lines, str(path), "at most" if kind == "distinct entries" else "not UTF-8")
    assert tree(model) == before
