"""Data safety: outputs never replace what is not ours, one writer per output, atomic and readable outputs,
checks at compile time instead of crashes at generate time, prompts never swapped or dropped, every loaded file
verified."""
import hashlib
import json
import os
from pathlib import Path

import pytest

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.artifact.manifest import MANIFEST, read_manifest, seal
from neuron_infer.checkpoint import checkpoint_fingerprint
from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.output_dir import mark
from tests.test_bad_input import TINY, compile_fails, fresh_copy, run_cli
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint, write_tiny_tokenizer

BUILD = BuildConfig.from_dict(json.loads(Path("configs/tiny.json").read_text())["build"])
QUIET = {"backend": "cpu-eager", "say": lambda m: None}


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def artifact(tiny_dirs, tmp_path):
    out = tmp_path / "art"
    compile_model(tiny_dirs("gqa"), out, BUILD, **QUIET)
    return out


# 1. --overwrite replaces only a previous artifact or an empty directory, never the checkpoint ------------------

def test_output_is_never_the_checkpoint_or_a_directory_containing_it(tiny_dirs, tmp_path, capsys):
    ck = fresh_copy(tiny_dirs, tmp_path)
    before = snapshot(ck)
    for out in (ck, tmp_path):
        code, msg = run_cli(["compile", str(ck), "-o", str(out), "--overwrite", *TINY], capsys)
        assert code == 2 and msg.startswith("error: ") and "input directory" in msg, msg
    assert snapshot(ck) == before


def test_overwrite_refuses_a_directory_of_user_files(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, msg = run_cli(["compile", str(tiny_dirs("gqa")), "-o", str(out), "--overwrite", *TINY], capsys)
    assert code == 2 and "not a neuron-infer compiled artifact" in msg
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"keep me").hexdigest()}


def test_overwrite_refuses_an_artifact_holding_user_files(artifact, tiny_dirs, capsys):
    (artifact / "graphs" / "notes.txt").write_text("keep me")
    before = snapshot(artifact)
    code, msg = run_cli(["compile", str(tiny_dirs("gqa")), "-o", str(artifact), "--overwrite", *TINY], capsys)
    assert code == 2 and "graphs/notes.txt" in msg
    assert snapshot(artifact) == before


def test_overwrite_replaces_a_previous_artifact_and_an_empty_dir_is_used(artifact, tiny_dirs, tmp_path, capsys):
    old = read_manifest(artifact).checkpoint_fingerprint
    code, _ = run_cli(["compile", str(tiny_dirs("mha")), "-o", str(artifact), "--overwrite", *TINY], capsys)
    assert code == 0 and read_manifest(artifact).checkpoint_fingerprint != old
    (tmp_path / "empty").mkdir()
    code, _ = run_cli(["compile", str(tiny_dirs("mha")), "-o", str(tmp_path / "empty"), *TINY], capsys)
    assert code == 0 and (tmp_path / "empty" / MANIFEST).is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no lock or temporary left"


@pytest.mark.parametrize("spelling", ["{ck}", "{ck}/", ".", "../{name}"])
def test_generate_on_a_checkpoint_suggests_a_new_output_directory(tiny_dirs, capsys, monkeypatch, spelling):
    ck = Path(tiny_dirs("gqa"))
    monkeypatch.chdir(ck)
    arg = spelling.format(ck=ck, name=ck.name)
    code, msg = run_cli(["generate", arg, "--prompt", "hi"], capsys)
    assert code == 2 and f"neuron-infer compile {Path(arg)} -o " in msg
    suggested = msg.split(" -o ", 1)[1].split("`", 1)[0]
    out = Path(suggested).resolve()
    assert not suggested.startswith("-") and out != ck and out not in ck.parents and ck not in out.parents, msg


# 2. one writer per output ----------------------------------------------------------------------------------------

def test_a_second_compile_into_the_same_output_is_refused(tiny_dirs, tmp_path, monkeypatch):
    from neuron_infer.compile import builder

    out, real, seen = tmp_path / "art", builder.compile_graphs, []

    def racing(*a, **k):
        if not seen:  # while the first compile runs, a second one targets the same -o
            seen.append("second")
            with pytest.raises(NeuronInferError, match="being written by another neuron-infer process"):
                compile_model(tiny_dirs("mha"), out, BUILD, overwrite=True, **QUIET)
            seen.append(sorted(p.name for p in tmp_path.glob(".art.partial-*")))
        return real(*a, **k)

    monkeypatch.setattr(builder, "compile_graphs", racing)
    compile_model(tiny_dirs("gqa"), out, BUILD, **QUIET)
    assert len(seen[1]) == 1, "the running compile's partial directory survives the refused one"
    assert read_manifest(out).checkpoint_fingerprint == checkpoint_fingerprint(tiny_dirs("gqa"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_appearing_during_a_compile_is_not_replaced(tiny_dirs, tmp_path, monkeypatch, overwrite):
    from neuron_infer.compile import builder

    out, real = tmp_path / "art", builder.compile_graphs

    def another_program(*a, **k):
        out.mkdir()
        (out / "data.csv").write_text("user data")
        return real(*a, **k)

    monkeypatch.setattr(builder, "compile_graphs", another_program)
    with pytest.raises(NeuronInferError, match="not a neuron-infer compiled artifact"):
        compile_model(tiny_dirs("gqa"), out, BUILD, overwrite=overwrite, **QUIET)
    assert snapshot(out) == {"data.csv": hashlib.sha256(b"user data").hexdigest()}
    assert not list(tmp_path.glob(".art.*"))


def test_cache_fills_wait_for_each_other_and_compile_once(tiny_dirs, tmp_path):
    import threading

    from neuron_infer.output_dir import one_at_a_time

    out, compiled, errors = tmp_path / "cache" / "art", [], []

    def fill():  # the shape of the default-model and vLLM plugin caches
        try:
            with one_at_a_time(out):
                if not (out / MANIFEST).is_file():
                    compile_model(tiny_dirs("gqa"), out, BUILD, overwrite=True, **QUIET)
                    compiled.append(1)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=fill) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and compiled == [1]
    CompiledModel.load(out)


def test_vllm_plugin_cache_compiles_while_it_waits_its_turn(tiny_dirs, tmp_path):
    from neuron_infer.vllm_plugin.artifacts import EngineArgs, ensure_artifact

    args = EngineArgs(model=str(tiny_dirs("gqa")), dtype="float32", max_model_len=64, max_num_seqs=1)
    options = {"neuron_infer_cache_dir": str(tmp_path / "cache"), "neuron_infer_backend": "cpu-eager"}
    root = ensure_artifact(args, options, say=lambda m: None)
    assert read_manifest(root).checkpoint_fingerprint == checkpoint_fingerprint(tiny_dirs("gqa"))
    assert ensure_artifact(args, options, say=lambda m: None) == root


# 3. empty prompts are refused, naming which one ------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--prompt", ""], "--prompt #1 is empty"),
    (["--prompt", "hello", "--prompt", " \t"], "--prompt #2 is only whitespace"),
])
def test_empty_prompt_is_refused(artifact, capsys, args, words):
    code, msg = run_cli(["generate", str(artifact), *args, "--max-new-tokens", "2"], capsys)
    assert code == 2 and msg.startswith("error: ") and words in msg


@pytest.mark.parametrize("text, words", [("", "is empty; write one prompt"), ("first\n\nthird\n", "line 2 is empty")])
def test_empty_prompt_file_or_line_is_refused(artifact, tmp_path, capsys, text, words):
    (tmp_path / "prompts.txt").write_text(text)
    code, msg = run_cli(["generate", str(artifact), "--prompt-file", str(tmp_path / "prompts.txt")], capsys)
    assert code == 2 and words in msg


def test_api_refuses_an_empty_prompt_in_a_batch(artifact):
    with pytest.raises(NeuronInferError, match="prompt 1 is empty"):
        CompiledModel.load(artifact).generate(["a", "", "b"], max_new_tokens=2)


# 4, 5. tokenizer problems stop the compile -----------------------------------------------------------------------

def test_tokenizer_with_more_ids_than_the_vocab_fails_at_compile(tmp_path, capsys):
    ck = write_tiny_checkpoint(tmp_path / "model", tokenizer=False, **{**TINY_PRESETS["gqa"], "vocab_size": 300})
    write_tiny_tokenizer(ck, vocab_size=320)
    msg = compile_fails(ck, tmp_path, capsys)
    assert "token ids up to 319" in msg and "vocab_size=300" in msg


def test_checkpoint_without_tokenizer_fails_at_compile(tiny_dirs, tmp_path, capsys):
    ck = fresh_copy(tiny_dirs, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ck / name).unlink(missing_ok=True)
    assert "no tokenizer in" in compile_fails(ck, tmp_path, capsys)


def test_token_ids_past_the_vocabulary_are_refused_before_running(artifact):
    with pytest.raises(NeuronInferError, match="token id 512, outside this model's vocabulary 0..511"):
        CompiledModel.load(artifact).generate_ids([[1, 5], [1, 512]], max_new_tokens=2)


# 6. every file a load reads is listed in the manifest and verified -----------------------------------------------

def test_a_file_missing_from_the_manifest_is_not_loaded(artifact, capsys):
    m = json.loads((artifact / MANIFEST).read_text())
    del m["files"]["weights/rank0.safetensors"]
    (artifact / MANIFEST).write_text(json.dumps(seal(m)))
    code, msg = run_cli(["generate", str(artifact), "--prompt", "hi"], capsys)
    assert code == 2 and "rank0.safetensors is not listed" in msg


# 7. interrupted work is cleaned; quantize is atomic and never merges ---------------------------------------------

def test_stale_partial_directories_are_removed_by_the_next_compile(tiny_dirs, tmp_path):
    stale = tmp_path / ".art.partial-k3_x9q0z"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / "rank0.safetensors").write_bytes(b"left by a killed compile")
    mark(stale)  # every temporary directory of a writer carries the marker
    other = tmp_path / ".other.partial-k3_x9q0z"  # another output's: not ours to judge
    other.mkdir()
    mark(other)
    unmarked = [tmp_path / ".art.partial-a1b2c3d4", tmp_path / ".art.old-123"]  # the names alone: not ours
    for d in unmarked:
        d.mkdir()
        (d / "notes.txt").write_text("mine")
    compile_model(tiny_dirs("gqa"), tmp_path / "art", BUILD, **QUIET)
    assert not stale.exists() and other.is_dir()
    assert all((d / "notes.txt").read_text() == "mine" for d in unmarked)


def test_killed_quantize_leaves_nothing(tiny_dirs, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    def killed_while_writing(state, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed_while_writing)
    code, _ = run_cli(["quantize", str(tiny_dirs("gqa")), "-o", str(tmp_path / "q"), "--quant", "int8"], capsys)
    assert code == 130 and not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.*"))


def test_quantize_overwrite_replaces_instead_of_merging(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "q"
    assert run_cli(["quantize", str(tiny_dirs("gqa")), "-o", str(out), "--quant", "int8"], capsys)[0] == 0
    assert (out / "tokenizer.json").is_file()
    bare = fresh_copy(tiny_dirs, tmp_path)
    for p in bare.glob("tokenizer*"):
        p.unlink()
    code, _ = run_cli(["quantize", str(bare), "-o", str(out), "--quant", "int8", "--overwrite"], capsys)
    assert code == 0 and not (out / "tokenizer.json").exists(), "the old output's files are gone"


def test_quantize_never_writes_into_its_input_or_user_files(tiny_dirs, tmp_path, capsys):
    ck = fresh_copy(tiny_dirs, tmp_path)
    before = snapshot(ck)
    code, msg = run_cli(["quantize", str(ck), "-o", str(ck), "--quant", "int8", "--overwrite"], capsys)
    assert code == 2 and "input directory" in msg and snapshot(ck) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    code, msg = run_cli(["quantize", str(ck), "-o", str(tmp_path / "mine"), "--quant", "int8", "--overwrite"], capsys)
    assert code == 2 and "not a neuron-infer quantize output" in msg and (tmp_path / "mine" / "notes.txt").is_file()


# 8. outputs respect the umask ------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_respect_the_umask(tiny_dirs, tmp_path, capsys, umask):
    old = os.umask(umask)
    try:
        compile_model(tiny_dirs("gqa"), tmp_path / "art", BUILD, **QUIET)
        assert run_cli(["quantize", str(tiny_dirs("gqa")), "-o", str(tmp_path / "q"), "--quant", "int8"], capsys)[0] == 0
    finally:
        os.umask(old)
    for root in (tmp_path / "art", tmp_path / "q"):
        modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}
        want = {k: (0o777 if (tmp_path / k).is_dir() else 0o666) & ~umask for k in modes}
        assert modes == want


# 9. the security note names every native-code file an artifact can hold -------------------------------------------

def test_security_note_names_the_native_code_files():
    from neuron_infer.backends.cpu import graph as cpu
    from neuron_infer.backends.cpu import kernels as cpu_gemv

    text = (Path(__file__).parents[1] / "docs" / "security.md").read_text()
    for suffix in (cpu.PACKAGE_SUFFIX, cpu_gemv.LIB_SUFFIX):
        assert f"*{suffix}`" in text, suffix  # e.g. `graphs/*.pt2`
    assert ".bin" in text and "pickle" in text  # the checkpoint side of the same rule
