"""Stop strings: the incremental check in the one stop rule (runtime/sequence.py), the cut text, the streamers'
hold-back, and `--stop` through the API and the CLI on a tiny artifact."""
import json

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.cli_io import JsonLinesStreamer, stable_text
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.sequence import Sequence, StopRule, cut_at_stop
from tests.test_cli_generate_io import run_main
from tests.tiny_artifact import compile_tiny

PIECES = ["a", "b", "\n", "ab", "c", "User", ":", " "]  # a tiny tokenizer: id -> its text


def decode(ids):
    return "".join(PIECES[i] for i in ids)


class TinyTok:
    def decode(self, ids, skip_special_tokens=True):
        return decode(ids)


def seq(stop_strings, max_new_tokens=100, eos=(), calls=None):
    def dec(ids):
        if calls is not None:
            calls.append(len(ids))
        return decode(ids)

    rule = StopRule(max_new_tokens, eos, False, None, tuple(stop_strings), dec)
    return Sequence(0, [0], SamplingConfig(), rule, None)


def test_a_stop_string_split_across_tokens_stops_on_the_token_that_completes_it():
    s = seq(["b\n"])
    assert s.append([0, 4]) == [0, 4] and not s.finished
    assert s.append([1, 2, 0, 0]) == [1, 2]  # "b" then "\n": stops there, the rest is dropped
    assert s.finish_reason == "stop" and s.output == [0, 4, 1, 2]


def test_a_token_that_holds_a_whole_stop_string_with_more_text_stops():
    s = seq(["ba"])
    s.append([1])
    assert s.append([3]) == [3] and s.finish_reason == "stop"  # "b" + "ab" contains "ba"


def test_eos_comes_before_stop_strings_and_stop_strings_before_the_count():
    s = seq(["c"], eos=(4,))
    s.append([4])
    assert s.finish_reason == "eos"
    s = seq(["c"], max_new_tokens=1)
    s.append([4])
    assert s.finish_reason == "stop"
    s = seq(["zz"], max_new_tokens=2)
    s.append([0, 1])
    assert s.finish_reason == "max_new_tokens"


def test_the_check_decodes_only_a_tail_window():
    calls = []
    s = seq(["User:"], max_new_tokens=None, calls=calls)
    for _ in range(200):
        s.append([0])
    s.append([5, 6])
    assert s.finish_reason == "stop" and len(s.output) == 202
    window = s.stop.tail_tokens
    assert max(calls) == window < 202  # never the whole output


def test_without_stop_strings_nothing_is_decoded():
    s = Sequence(0, [0], SamplingConfig(), StopRule(3), None)
    s.append([1, 2, 3, 4])
    assert s.output == [1, 2, 3] and s.finish_reason == "max_new_tokens"


@pytest.mark.parametrize("bad", [[""], [3]])
def test_bad_stop_strings_are_one_clear_error(bad):
    with pytest.raises(NeuronInferError, match="stop strings"):
        StopRule(stop_strings=tuple(bad), decode=decode)


def test_cut_before_the_earliest_stop_string():
    assert cut_at_stop("one\nUser: two", ("User:", "\n")) == "one"
    assert cut_at_stop("no stop here", ("User:",)) == "no stop here"


def test_streamed_text_holds_back_a_possible_stop_string_start():
    tok = TinyTok()
    assert stable_text(tok, [0, 7, 5], ("User:",)) == "a "  # "User" may start "User:"
    assert stable_text(tok, [0, 7, 5, 7], ("User:",)) == "a User "  # ruled out: shown
    assert stable_text(tok, [0, 7, 5, 6, 0], ("User:",)) == "a "  # cut before it


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("stop") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def _stop_inside(text):
    """A stop string whose first occurrence in `text` is well inside it -> (stop, index)."""
    for i in range(3, len(text) - 3):
        cand = text[i:i + 2]
        if cand.strip() and text.find(cand) == i:
            return cand, i
    pytest.skip("the reference text has no usable stop string")


def test_generate_stops_at_a_stop_string_and_cuts_the_text(model):
    ref = model.generate(["The capital"], 24, ignore_eos=True).outputs[0]
    stop, at = _stop_inside(ref.text)
    out = model.generate(["The capital"], 24, ignore_eos=True, stop=(stop,)).outputs[0]
    assert out.finish_reason == "stop" and out.text == ref.text[:at]
    assert out.token_ids == ref.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    assert stop in model.tokenizer.decode(out.token_ids)


def test_cli_stop_in_json_and_json_lines(art, model):
    ref = model.generate(["a"], 20, ignore_eos=True).outputs[0]
    stop, at = _stop_inside(ref.text)
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--max-new-tokens", "20", "--ignore-eos",
                               "--json", "--stop", stop, "--stop", "\x00never"])
    assert code == 0, err
    o = json.loads(out)["outputs"][0]
    assert o["finish_reason"] == "stop" and o["text"] == ref.text[:at]
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--max-new-tokens", "20", "--ignore-eos",
                               "--json", "--stream", "--stop", stop])
    records = [json.loads(line) for line in out.splitlines()]
    deltas = [r for r in records if r["type"] == "delta"]
    assert "".join(r["text"] for r in deltas) == records[-1]["outputs"][0]["text"] == ref.text[:at]
    assert all(stop not in "".join(r["text"] for r in deltas[:j]) for j in range(len(deltas) + 1))


def test_json_lines_streamer_never_shows_a_stop_string(capsys):
    s = JsonLinesStreamer(TinyTok(), ("User:",))
    for n in range(1, 6):
        s([[0, 7, 5, 6, 0][:n]])
    shown = "".join(json.loads(line)["text"] for line in capsys.readouterr().out.splitlines())
    assert shown == "a "
