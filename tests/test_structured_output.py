"""Structured output outside vLLM: `generate --json-schema FILE / --regex / --choice` and `grammar=` in Python, on a
tiny artifact with its tokenizer (xgrammar, an optional dependency: these tests skip without it)."""
import json
import re

import pytest

from neuron_infer.api import CompiledModel
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ConfigError, NeuronInferError
from neuron_infer.runtime.grammar import GrammarSpec
from tests.test_cli_generate_io import run_main
from tests.tiny_artifact import compile_tiny

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def test_a_grammar_spec_takes_exactly_one_kind():
    with pytest.raises(ConfigError, match="exactly one"):
        GrammarSpec(regex="a", choice=("b",))
    with pytest.raises(ConfigError, match="exactly one"):
        GrammarSpec()
    with pytest.raises(ConfigError, match="not valid JSON"):
        GrammarSpec(json_schema="{nope")
    with pytest.raises(ConfigError, match="non-empty"):
        GrammarSpec(choice=("a", ""))


def test_cli_refuses_bad_structured_flags_before_loading(tmp_path):
    code, _, err = run_main(["generate", str(tmp_path / "none"), "--prompt", "a", "--regex", "a", "--choice", "b"])
    assert code == 2 and err.startswith("error: --json-schema, --regex and --choice exclude each other")
    code, _, err = run_main(["generate", str(tmp_path / "none"), "--prompt", "a", "--json-schema",
                             str(tmp_path / "missing.json")])
    assert code == 2 and err.startswith("error: --json-schema") and "cannot read it" in err
    code, _, err = run_main(["generate", str(tmp_path / "none"), "--prompt", "a", "--choice", "x", "--ignore-eos"])
    assert code == 2 and "drop ignore_eos" in err


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    pytest.importorskip("xgrammar")
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("grammar") / "a")


@pytest.fixture(scope="module")
def model(art):
    return CompiledModel.load(art)


def test_sampled_json_schema_outputs_all_validate(model):
    jsonschema = pytest.importorskip("jsonschema")
    spec = GrammarSpec(json_schema=json.dumps(SCHEMA))
    texts = []
    for seed in range(20):
        out = model.generate(["Pick:"], 60, SamplingConfig(temperature=1.0, seed=seed), grammar=spec).outputs[0]
        assert out.finish_reason == "eos", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
        texts.append(out.text)
    assert len(set(texts)) > 1  # really sampled


def test_regex_and_choice_in_a_batch(model):
    outs = model.generate(["a", "The capital"], 30, SamplingConfig(temperature=0.8, seed=1),
                          grammar=GrammarSpec(regex="[abc]{3}-[0-9]{2}")).outputs
    assert all(re.fullmatch("[abc]{3}-[0-9]{2}", o.text) for o in outs)
    outs = model.generate(["a", "b"], 10, grammar=GrammarSpec(choice=("yes", "no", "maybe"))).outputs
    assert all(o.text in ("yes", "no", "maybe") and o.finish_reason == "eos" for o in outs)


def test_cli_json_schema_regex_and_choice(art, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--json", "--temperature", "1", "--seed",
                               "3", "--json-schema", str(schema), "--max-new-tokens", "60"])
    assert code == 0, err
    o = json.loads(out)["outputs"][0]
    assert json.loads(o["text"])["color"] in ("red", "green", "blue") and o["finish_reason"] == "eos"
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--json", "--regex", "[0-9]{4}"])
    assert code == 0, err
    assert re.fullmatch("[0-9]{4}", json.loads(out)["outputs"][0]["text"])
    code, out, err = run_main(["generate", str(art), "--prompt", "a", "--choice", "left", "--choice", "right"])
    assert code == 0, err
    assert out.strip() in ("left", "right")


def test_a_regex_the_compiler_refuses_is_one_clear_error(model):
    with pytest.raises((ConfigError, NeuronInferError), match="does not compile"):
        model.generate(["a"], 5, grammar=GrammarSpec(regex="(unclosed"))
