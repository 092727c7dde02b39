"""`neuron-infer chat`: multi-turn conversation through the chat template, streamed answers, /exit and EOF."""
import pytest
from click.testing import CliRunner

from neuron_infer.api import CompiledModel, encode_chat
from neuron_infer.cli import cli
from neuron_infer.cli_chat import fit_conversation
from neuron_infer.errors import NeuronInferError
from tests.tiny_artifact import compile_tiny, relist

N = 10  # tokens per answer


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("chat") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def answer(model, messages):
    return model.generate_chat(messages, N).outputs[0].text


def chat(art, stdin, *args):
    return CliRunner().invoke(cli, ["chat", str(art), "--max-new-tokens", str(N), *args], input=stdin)


def test_two_turns_keep_the_conversation(art, model):
    r = chat(art, "Hello there\nAnd then?\n/exit\nnever read\n", "--system", "You are brief.")
    assert r.exit_code == 0, r.output
    conv = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello there"}]
    first = answer(model, conv)
    conv += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = answer(model, conv)
    assert r.stdout == f"{first}\n{second}\n"
    # the second answer depends on the first turn: without the history it is another answer
    assert second != answer(model, [{"role": "system", "content": "You are brief."}, conv[-1]])


def test_end_of_input_ends_the_chat_and_blank_lines_are_skipped(art, model):
    r = chat(art, "\n   \nHello there")  # no trailing newline, no /exit
    assert r.exit_code == 0
    assert r.stdout == answer(model, [{"role": "user", "content": "Hello there"}]) + "\n"


def test_reset_forgets_the_turns(art, model):
    r = chat(art, "Hello there\n/reset\nAnd then?\n")
    assert r.exit_code == 0
    first = answer(model, [{"role": "user", "content": "Hello there"}])
    assert r.stdout == f"{first}\n{answer(model, [{'role': 'user', 'content': 'And then?'}])}\n"


def test_a_too_long_message_is_reported_and_the_chat_goes_on(art, model):
    r = chat(art, "x" * 600 + "\nHello there\n")
    assert r.exit_code == 0
    assert "error: this message" in r.stderr and "max_context_length=256" in r.stderr
    assert r.stdout == answer(model, [{"role": "user", "content": "Hello there"}]) + "\n"


def test_oldest_turns_are_dropped_to_fit(model):
    tok = model.tokenizer
    sys_msg = {"role": "system", "content": "Be brief."}
    turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
             {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"},
             {"role": "user", "content": "third"}]
    full = len(encode_chat(tok, [sys_msg, *turns]))
    notes = []
    kept, ids = fit_conversation(tok, [sys_msg, *turns], full - 1, notes.append)
    assert kept == [sys_msg, *turns[2:]] and ids == encode_chat(tok, kept) and len(notes) == 1
    kept, _ = fit_conversation(tok, [sys_msg, *turns], len(encode_chat(tok, [sys_msg, turns[-1]])), notes.append)
    assert kept == [sys_msg, turns[-1]]
    with pytest.raises(NeuronInferError, match="more than max_context_length"):
        fit_conversation(tok, [sys_msg, *turns], 3, notes.append)


def test_a_tokenizer_without_chat_template_is_refused_before_loading(art, tmp_path, monkeypatch):
    import json
    import shutil

    dst = tmp_path / "a"
    shutil.copytree(art, dst)
    cfg_path = dst / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (dst / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)
    relist(dst)  # compiled from a checkpoint without a template
    monkeypatch.setattr(CompiledModel, "load", lambda *a, **k: pytest.fail("loaded before the check"))
    r = chat(dst, "hi\n")
    assert isinstance(r.exception, NeuronInferError) and "no chat template" in str(r.exception)
