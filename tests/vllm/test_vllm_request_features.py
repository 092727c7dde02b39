"""min_tokens, logit_bias, prompt_logprobs, echo with logprobs, structured outputs and tool calls through vLLM's OpenAI server with the official
`openai` client: the plugin's greedy responses equal neuron-infer's own generation and stock vLLM CPU's (plugin
off), on the same tiny fp32 checkpoint (logprobs within TOL).

The requests are built from neuron-infer's greedy tokens r of each prompt, so every feature changes the output:
min_tokens holds back a stop token id that greedy decoding emits early (r[1]), logit_bias pushes the greedy first
token away (-100) and another token up. Greedy on fp32 on both sides: the tokens must be equal exactly (the
logprobs comparison in test_vllm_logprobs.py shows the two runners' fp32 logits agree to ~1e-6).
"""
from __future__ import annotations

import json
import re

import pytest

from tests.vllm.vllm_helpers import Server, require_vllm

require_vllm()

import jsonschema
import openai

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.runtime.generate import generate_ids

PROMPTS = [list(range(7, 27)), [5, 9, 33]]
N = 10
K = 3  # prompt logprobs: top alternatives per prompt token
TOL = 1e-4  # logprobs: fp32 on both sides, other kernels (see test_vllm_logprobs.py)
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
SAMPLED = 50  # structured requests at temperature 1.0, each with its own seed
SERVE = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.3",
         "--enforce-eager", "--served-model-name", "tiny", "--seed", "0",
         # xgrammar without optional whitespace: a random-weight model otherwise fills max_tokens with it
         "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def ours(tiny, tmp_path_factory):
    art = tmp_path_factory.mktemp("feat") / "art"
    build = BuildConfig(dtype="fp32", batch_size=4, max_context_length=128, max_length=128, kv_block_size=16)
    compile_model(tiny, art, build, backend="cpu-eager", say=lambda m: None)
    return art, CompiledModel.load(art)


def cases(model: CompiledModel) -> list[tuple[dict, SamplingConfig, tuple[int, ...]]]:
    """(request fields, the same as a SamplingConfig, stop token ids) per case."""
    out = []
    for p in PROMPTS:
        r = model.generate_ids([p], N, ignore_eos=True).outputs[0].token_ids
        bias = {r[0]: -100.0, r[2]: 4.0}
        out += [
            ({"prompt": p, "min_tokens": 6, "stop_token_ids": [r[1]], "ignore_eos": True},
             SamplingConfig(min_tokens=6), (r[1],)),
            ({"prompt": p, "logit_bias": bias, "ignore_eos": True}, SamplingConfig(logit_bias=bias), ()),
            ({"prompt": p, "logit_bias": {r[0]: -100.0}, "min_tokens": 4, "stop_token_ids": [r[3]],
              "ignore_eos": True},
             SamplingConfig(logit_bias={r[0]: -100.0}, min_tokens=4), (r[3],)),
        ]
    return out


def serve_all(server: Server, bodies: list[dict]) -> dict:
    """Each request through the official client (greedy) -> {"features": [{"ids", "finish"}, ...] per body,
    "prompt_logprobs": per prompt, "echo": per prompt}."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        server.wait_ready()
        got = {"features": [], "prompt_logprobs": [], "echo": []}
        for b in bodies:
            extra = {k: b[k] for k in ("min_tokens", "stop_token_ids", "ignore_eos") if k in b}
            bias = {str(t): v for t, v in b.get("logit_bias", {}).items()} or None
            c = client.completions.create(model="tiny", prompt=b["prompt"], max_tokens=N, temperature=0.0,
                                          logit_bias=bias, extra_body={**extra, "return_token_ids": True})
            choice = c.choices[0].model_dump()
            got["features"].append({"ids": choice["token_ids"], "finish": choice["finish_reason"]})
        for p in PROMPTS:
            c = client.completions.create(model="tiny", prompt=p, max_tokens=2, temperature=0.0,
                                          extra_body={"prompt_logprobs": K, "ignore_eos": True})
            got["prompt_logprobs"].append(c.choices[0].model_dump()["prompt_logprobs"])
            c = client.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0.0, echo=True,
                                          logprobs=2, extra_body={"ignore_eos": True})
            lp = c.choices[0].logprobs
            got["echo"].append({"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                                "top": lp.top_logprobs, "text": c.choices[0].text})
        got["structured"] = structured(client)
        got["tools"] = tool_calls(client)
        got["sampled_json"] = [client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=80, temperature=1.0, seed=i,
            extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0].text for i in range(SAMPLED)]
        return got
    finally:
        server.kill()


def structured(client: openai.OpenAI) -> list[dict]:
    """Greedy structured-output requests: choice and regex (completions), json_schema and json_object (chat)."""
    out = []
    for so in ({"choice": ["red", "green", "blue"]}, {"regex": "[abc]{3}-[0-9]{2}"}):
        c = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0.0,
                                      extra_body={"structured_outputs": so, "return_token_ids": True})
        out.append({"text": c.choices[0].text, "ids": c.choices[0].model_dump()["token_ids"]})
    formats = ({"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}, {"type": "json_object"})
    for fmt in formats:
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick one."}],
                                           max_tokens=40, temperature=0.0, response_format=fmt,
                                           extra_body={"return_token_ids": True})
        out.append({"text": c.choices[0].message.content, "ids": c.choices[0].model_dump()["token_ids"],
                    "finish": c.choices[0].finish_reason})
    return out


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}


def tool_calls(client: openai.OpenAI) -> list[dict]:
    """Greedy tool requests (--enable-auto-tool-choice --tool-call-parser hermes): tool_choice "required" and a
    named function (vLLM constrains both with structured outputs), and "auto" (the parser reads the text)."""
    out = []
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                           tools=[TOOL], tool_choice=choice, max_tokens=120, temperature=0.0)
        m = c.choices[0].message
        out.append({"content": m.content, "finish": c.choices[0].finish_reason,
                    "calls": [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]})
    return out


@pytest.fixture(scope="module")
def plugin(tiny, ours, tmp_path_factory):
    art, model = ours
    root = tmp_path_factory.mktemp("plugin")
    server = Server(tiny, [*SERVE, "--additional-config", json.dumps({"neuron_infer_artifacts": str(art)})],
                    root / "server.log")
    return serve_all(server, [b for b, _, _ in cases(model)])


def test_min_tokens_and_logit_bias_equal_neuron_infer(plugin, ours):
    """neuron-infer's runtime with the stop token ids as its EOS ids: held back by min_tokens, then ending the
    sequence with the stop token kept, as vLLM's stop_token_ids."""
    _, model = ours
    for (body, sampling, stops), got in zip(cases(model), plugin["features"], strict=True):
        (want,), _ = generate_ids(model.engine, [body["prompt"]], N, sampling, stops, ignore_eos=not stops)
        assert got["ids"] == want.token_ids, body
        assert got["finish"] == ("stop" if want.finish_reason == "eos" else "length")
        if stops:
            assert len(got["ids"]) >= sampling.min_tokens and not set(got["ids"][: sampling.min_tokens]) & set(stops)


def test_logit_bias_changes_the_output(plugin, ours):
    _, model = ours
    for (body, _, _), got in zip(cases(model), plugin["features"]):
        if "logit_bias" in body:
            banned = [t for t, v in body["logit_bias"].items() if v == -100.0]
            assert not set(got["ids"]) & set(banned)


def test_prompt_logprobs_and_echo_equal_neuron_infer(plugin, ours):
    """vLLM's layout (None for the first prompt token, then {id: {logprob, rank}} with the prompt token and the top
    K) filled from the runtime's prompt records; echo with logprobs is the same scores, the prompt's text first."""
    _, model = ours
    for p, got, echo in zip(PROMPTS, plugin["prompt_logprobs"], plugin["echo"], strict=True):
        (want,), _ = generate_ids(model.engine, [p], 1, prompt_logprobs=K, ignore_eos=True)
        assert got[0] is None and len(got) == len(p)
        for pos, rec in zip(got[1:], want.prompt_logprobs, strict=True):
            entries = {int(t): e for t, e in pos.items()}
            assert set(entries) == {rec["token_id"], *(i for i, _ in rec["top"])}
            assert entries[rec["token_id"]]["rank"] == rec["rank"]
            assert entries[rec["token_id"]]["logprob"] == pytest.approx(rec["logprob"], abs=TOL)
        assert echo["token_logprobs"][0] is None
        scored = [r["logprob"] for r in want.prompt_logprobs]
        assert echo["token_logprobs"][1: len(p)] == pytest.approx(scored, abs=TOL)


def test_structured_outputs_follow_their_grammar(plugin):
    choice, regex, schema, obj = plugin["structured"]
    assert choice["text"] in ("red", "green", "blue")
    assert re.fullmatch("[abc]{3}-[0-9]{2}", regex["text"])
    jsonschema.validate(json.loads(schema["text"]), SCHEMA)
    if obj["finish"] == "stop":  # json_object: any JSON object (it may still be open at max_tokens)
        assert isinstance(json.loads(obj["text"]), dict)


def test_tool_calls(plugin):
    """The grammar vLLM builds for the tool names what the model may emit: the named function's call is parsed into
    tool_calls, and "required" starts with a hermes tool call of the only tool (the random model then repeats calls
    until max_tokens, as stock vLLM does: test_plugin_equals_stock_vllm)."""
    required, named, auto = plugin["tools"]
    assert [name for name, _ in named["calls"]] == ["get_weather"] and named["finish"] == "stop"
    assert required["content"].startswith('<tool_call>\n{"name": "get_weather"')
    assert auto["finish"] in ("stop", "length", "tool_calls")


def test_sampled_structured_outputs_all_validate(plugin):
    """Temperature 1.0: every one of the SAMPLED outputs is JSON valid against the schema."""
    assert len(plugin["sampled_json"]) == SAMPLED
    for text in plugin["sampled_json"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(plugin["sampled_json"])) > 1  # really sampled


def _same(a, b, path="") -> None:
    """Equal structures, floats within TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=TOL), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.slow
def test_plugin_equals_stock_vllm(tiny, ours, plugin, tmp_path_factory):
    _, model = ours
    root = tmp_path_factory.mktemp("stock")
    stock = serve_all(Server(tiny, SERVE, root / "server.log", NEURON_INFER_VLLM="0"),
                      [b for b, _, _ in cases(model)])
    assert plugin["features"] == stock["features"]
    _same(plugin["prompt_logprobs"], stock["prompt_logprobs"], "prompt_logprobs")
    _same(plugin["echo"], stock["echo"], "echo")
    assert plugin["structured"] == stock["structured"]
    assert plugin["tools"] == stock["tools"]
