"""`generate`: the prompt from stdin, compact --json, JSON Lines streaming, cheap checks before the slow load."""
import json

import pytest
from click.testing import CliRunner

from neuron_infer.api import CompiledModel
from neuron_infer.cli import cli, main
from tests.tiny_artifact import compile_tiny


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("gio") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def run_main(args, stdin=""):
    """Run `neuron-infer ARGS` through main() (its error handling) with `stdin`; returns (code, stdout, stderr)."""
    runner = CliRunner()
    with runner.isolation(input=stdin) as (out, err, _mixed):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue().decode(), err.getvalue().decode()


def expected_ids(model, prompt, n=6):
    return model.generate([prompt], n, ignore_eos=True).outputs[0].token_ids


def test_piped_stdin_is_the_prompt_when_none_is_given(art, model):
    code, out, _ = run_main(["generate", str(art), "--max-new-tokens", "6", "--ignore-eos", "--json"],
                            stdin="Hello there\n")
    assert code == 0
    assert json.loads(out)["outputs"][0]["token_ids"] == expected_ids(model, "Hello there")


def test_prompt_dash_reads_stdin_among_other_prompts(art, model):
    code, out, _ = run_main(["generate", str(art), "--prompt", "one", "--prompt", "-", "--max-new-tokens", "6",
                             "--ignore-eos", "--json"], stdin="two words\n")
    assert code == 0
    got = [o["token_ids"] for o in json.loads(out)["outputs"]]
    assert got == [expected_ids(model, "one"), expected_ids(model, "two words")]


def test_prompt_dash_with_empty_stdin_is_an_error(art):
    code, out, err = run_main(["generate", str(art), "--prompt", "-"], stdin="")
    assert code == 2 and out == "" and err.strip().splitlines()[-1].startswith("error: --prompt -: stdin is empty")


@pytest.mark.parametrize("stdin", ["\n", "  \n\t\n"])
def test_piped_stdin_with_only_whitespace_is_an_error(art, monkeypatch, stdin):
    """`echo "$UNSET" | neuron-infer generate`: refused, never replaced by the default prompt."""
    monkeypatch.setattr(CompiledModel, "load", lambda *a, **k: pytest.fail("generated from an empty prompt"))
    code, out, err = run_main(["generate", str(art)], stdin=stdin)
    assert code == 2 and out == "" and "stdin is empty or only whitespace" in err.strip().splitlines()[-1]


def test_an_empty_pipe_or_file_is_an_error_but_dev_null_means_no_prompt(tmp_path, monkeypatch):
    import os
    import sys

    from neuron_infer.cli_io import resolve_stdin_prompts
    from neuron_infer.errors import NeuronInferError

    r, w = os.pipe()
    os.close(w)  # `printf '' | neuron-infer generate`
    (tmp_path / "empty.txt").write_text("")
    for source in (os.fdopen(r), open(tmp_path / "empty.txt")):  # noqa: SIM115
        with source:
            monkeypatch.setattr(sys, "stdin", source)
            with pytest.raises(NeuronInferError, match="stdin is empty"):
                resolve_stdin_prompts([], other_source=False)
    with open(os.devnull) as null:  # `< /dev/null`: no prompt given, the default applies
        monkeypatch.setattr(sys, "stdin", null)
        assert resolve_stdin_prompts([], other_source=False) == []


def test_stdin_that_is_not_utf8_is_one_error_line(art):
    runner = CliRunner()
    with runner.isolation(input=b"\xff\xfe bad") as (_out, err, _mixed), pytest.raises(SystemExit) as e:
        main(["generate", str(art), "--prompt", "-"])
    assert e.value.code == 2 and "stdin is not UTF-8" in err.getvalue().decode()


def test_stdin_is_left_alone_when_a_prompt_is_given(art, model):
    code, out, _ = run_main(["generate", str(art), "--prompt", "one", "--max-new-tokens", "6", "--ignore-eos",
                             "--json"], stdin="not a prompt\n")
    assert code == 0 and len(json.loads(out)["outputs"]) == 1
    assert json.loads(out)["outputs"][0]["token_ids"] == expected_ids(model, "one")


def test_json_is_one_line(art, model):
    code, out, _ = run_main(["generate", str(art), "--prompt", "a", "--prompt", "b", "--max-new-tokens", "5",
                             "--ignore-eos", "--json"])
    assert code == 0 and out.count("\n") == 1
    d = json.loads(out)
    assert [len(o["token_ids"]) for o in d["outputs"]] == [5, 5] and d["metrics"]["tokens_per_s"] > 0


def test_json_stream_is_json_lines_whose_deltas_add_up_to_the_result(art, model):
    code, out, _ = run_main(["generate", str(art), "--prompt", "a", "--prompt", "The capital", "--max-new-tokens",
                             "12", "--ignore-eos", "--json", "--stream"])
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    deltas, result = records[:-1], records[-1]
    assert result["type"] == "result" and {r["type"] for r in deltas} == {"delta"}
    assert len(deltas) >= 12  # at least one record per step for one of the rows
    for i, o in enumerate(result["outputs"]):
        mine = [r for r in deltas if r["index"] == i]
        assert [t for r in mine for t in r["token_ids"]] == o["token_ids"]
        assert "".join(r["text"] for r in mine) == o["text"]
    assert result["outputs"][1]["token_ids"] == model.generate(["The capital"], 12, ignore_eos=True
                                                                ).outputs[0].token_ids


def test_stream_without_json_is_refused(art):
    code, _, err = run_main(["generate", str(art), "--prompt", "a", "--stream"])
    assert code == 2 and "--stream" in err and "--json" in err


def test_text_output_streams_the_final_text(art, model):
    code, out, _ = run_main(["generate", str(art), "--prompt", "The capital", "--max-new-tokens", "16",
                             "--ignore-eos"])
    assert code == 0
    assert out == model.generate(["The capital"], 16, ignore_eos=True).outputs[0].text + "\n"


@pytest.mark.parametrize(("args", "needle"), [
    (["--prompt", "x" * 400], "more than max_context_length=256"),
    (["--prompt", "hello", "--max-new-tokens", "400"], "more than max_length=320; use --max-new-tokens <="),
    (["--prompt", "hello", "--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
])
def test_cheap_checks_fail_before_the_slow_load(art, monkeypatch, args, needle):
    def slow_load(*a, **k):
        raise AssertionError("the slow load ran before the cheap checks")

    monkeypatch.setattr(CompiledModel, "load", slow_load)
    code, _, err = run_main(["generate", str(art), *args])
    assert code == 2 and needle in err.strip().splitlines()[-1]


def test_default_max_new_tokens_fits_what_room_is_left(art, model):
    """Without --max-new-tokens, a prompt near max_length generates up to max_length (no error)."""
    prompt = "The capital of France is Paris. " * 15
    n = len(model.encode(prompt))
    assert n <= 256 and 320 - n < 128  # fits the context bucket; the default 128 new tokens would not fit
    code, out, _ = run_main(["generate", str(art), "--prompt", prompt, "--ignore-eos", "--json"])
    o = json.loads(out)["outputs"][0]
    assert code == 0 and o["finish_reason"] == "max_length" and len(o["token_ids"]) == 320 - n


def test_generate_help_groups_the_build_flags_apart():
    text = CliRunner().invoke(cli, ["generate", "--help"]).output
    build = text.index("Build options")
    assert build > text.index("--temperature") and build > text.index("--json")
    assert build < text.index("--dtype") and build < text.index("--quant") and build < text.index("--config")


def test_without_artifacts_the_checks_run_before_the_default_compile(tiny_dirs, tmp_path, monkeypatch):
    import neuron_infer.embedded as embedded
    import neuron_infer.presets as presets

    monkeypatch.setenv("NEURON_INFER_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "default_model_dir", lambda log=None: tiny_dirs("gqa"))
    monkeypatch.setattr(presets, "default_artifact_dir", lambda *a: pytest.fail("compiled before the checks"))
    code, _, err = run_main(["generate", "--config", "tiny", "--prompt", "hello", "--max-new-tokens", "200"])
    assert code == 2 and "more than max_length=128" in err.strip().splitlines()[-1]


def test_a_terminal_stdin_is_never_read(monkeypatch):
    """No prompt and stdin on a terminal: stdin is never read (the default prompt applies)."""
    import io
    import sys

    from neuron_infer.cli_io import resolve_stdin_prompts

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Tty("typed text\n"))
    assert resolve_stdin_prompts([], other_source=False) == []
    assert sys.stdin.read() == "typed text\n"
    monkeypatch.setattr(sys, "stdin", None)  # e.g. a daemon without stdin
    assert resolve_stdin_prompts([], other_source=False) == []


def test_streamers_print_as_tokens_arrive_and_hold_back_a_split_character(model, capsys):
    """'é' is two byte-level tokens: after the first one only the text before it may be shown."""
    import io
    import sys

    from neuron_infer.cli_io import JsonLinesStreamer, TextStreamer

    tok = model.tokenizer
    ids = tok("Paris é fin", add_special_tokens=False)["input_ids"]
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        s = TextStreamer(tok)
        shown = []
        for i in range(1, len(ids) + 1):
            s([ids[:i]])
            shown.append(out.getvalue())
        s.finish(tok.decode(ids))
    finally:
        sys.stdout = sys_stdout
    assert "\ufffd" not in "".join(shown) and shown[split - 1] == tok.decode(ids[:split - 1])
    assert len(set(shown)) > 3 and out.getvalue() == "Paris é fin"  # grew step by step, ends complete
    j = JsonLinesStreamer(tok)
    for i in range(1, len(ids) + 1):
        j([ids[:i]])
    import json

    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert "".join(r["text"] for r in recs) == "Paris é fin" and [t for r in recs for t in r["token_ids"]] == ids
    assert all("\ufffd" not in r["text"] for r in recs)


def test_kv_cache_budget_and_prefix_caching_flags(art, model):
    """--no-prefix-caching and --prefill-chunk give the same tokens; a --kv-cache-gib below one max_length sequence
    is one error line, a negative chunk a usage error."""
    want = expected_ids(model, "Hello there")
    for flags in ([], ["--no-prefix-caching"], ["--prefill-chunk", "0"], ["--prefill-chunk", "16"]):
        code, out, _ = run_main(["generate", str(art), "--prompt", "Hello there", "--prompt", "Hello there",
                                 "--max-new-tokens", "6", "--ignore-eos", "--json", *flags])
        assert code == 0 and [o["token_ids"] for o in json.loads(out)["outputs"]] == [want, want]
    code, out, err = run_main(["generate", str(art), "--prompt", "Hi", "--kv-cache-gib", "0.000001"])
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: --kv-cache-gib 1e-06 holds")
    code, out, err = run_main(["generate", str(art), "--prompt", "Hi", "--prefill-chunk", "-1"])
    assert code == 2 and out == "" and "--prefill-chunk" in err and "Traceback" not in err
