"""min_tokens and logit_bias through vLLM's OpenAI server with the official `openai` client: the plugin's greedy
responses equal neuron-infer's own generation and stock vLLM CPU's (plugin off), on the same tiny fp32 checkpoint.

The requests are built from neuron-infer's greedy tokens r of each prompt, so every feature changes the output:
min_tokens holds back a stop token id that greedy decoding emits early (r[1]), logit_bias pushes the greedy first
token away (-100) and another token up. Greedy on fp32 on both sides: the tokens must be equal exactly (the
logprobs comparison in test_vllm_logprobs.py shows the two runners' fp32 logits agree to ~1e-6).
"""
from __future__ import annotations

import json

import pytest

from tests.vllm.vllm_helpers import Server, require_vllm

require_vllm()

import openai

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.runtime.generate import generate_ids

PROMPTS = [list(range(7, 27)), [5, 9, 33]]
N = 10
SERVE = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.3",
         "--enforce-eager", "--served-model-name", "tiny", "--seed", "0"]


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


def serve_all(server: Server, bodies: list[dict]) -> list[dict]:
    """Each request through the official client (greedy) -> {"ids", "finish"}."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        server.wait_ready()
        got = []
        for b in bodies:
            extra = {k: b[k] for k in ("min_tokens", "stop_token_ids", "ignore_eos") if k in b}
            bias = {str(t): v for t, v in b.get("logit_bias", {}).items()} or None
            c = client.completions.create(model="tiny", prompt=b["prompt"], max_tokens=N, temperature=0.0,
                                          logit_bias=bias, extra_body={**extra, "return_token_ids": True})
            choice = c.choices[0].model_dump()
            got.append({"ids": choice["token_ids"], "finish": choice["finish_reason"]})
        return got
    finally:
        server.kill()


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
    for (body, sampling, stops), got in zip(cases(model), plugin, strict=True):
        (want,), _ = generate_ids(model.engine, [body["prompt"]], N, sampling, stops, ignore_eos=not stops)
        assert got["ids"] == want.token_ids, body
        assert got["finish"] == ("stop" if want.finish_reason == "eos" else "length")
        if stops:
            assert len(got["ids"]) >= sampling.min_tokens and not set(got["ids"][: sampling.min_tokens]) & set(stops)


def test_logit_bias_changes_the_output(plugin, ours):
    _, model = ours
    for (body, _, _), got in zip(cases(model), plugin):
        if "logit_bias" in body:
            banned = [t for t, v in body["logit_bias"].items() if v == -100.0]
            assert not set(got["ids"]) & set(banned)


@pytest.mark.slow
def test_plugin_equals_stock_vllm(tiny, ours, plugin, tmp_path_factory):
    _, model = ours
    root = tmp_path_factory.mktemp("stock")
    stock = serve_all(Server(tiny, SERVE, root / "server.log", NEURON_INFER_VLLM="0"),
                      [b for b, _, _ in cases(model)])
    assert plugin == stock
