"""Prompt logprobs from the prefill: every prompt token after the first scored by the logits of the position before
it, against Hugging Face's fp32 log-softmax on the same tiny checkpoint; the one-row-per-call path of static compiled
graphs (Neuron) against the all-rows path of eager graphs (the compiled CPU prefill class takes all rows:
tests/compile/test_shape_classes.py); chunked prefill and the prefix cache.

Tolerance 1e-4 (absolute, logprobs), as tests/vllm/test_vllm_logprobs.py: both sides fp32, different kernels and
summation orders (a paged KV cache and bucketed context graph vs HF's full-sequence forward); top-n ids and ranks
must be equal exactly.
"""
import pytest
import torch

from neuron_infer.api import CompiledModel
from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.options import RunOptions
from neuron_infer.vllm_plugin.runner import SlotRunner
from tests.tiny_artifact import compile_tiny

TOL = 1e-4
PROMPTS = [[5, 9, 14, 3, 3, 77, 120, 8, 41, 2, 9, 14, 3, 200, 17, 17, 64, 5, 9, 14], [7, 300, 12]]
N = 4


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return tiny_dirs("gqa")


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    build = BuildConfig(dtype="fp32", batch_size=2, max_context_length=32, max_length=64, context_buckets=(8, 32),
                        tokengen_buckets=(64,), kv_block_size=8)
    return CompiledModel.load(compile_tiny(tiny, tmp_path_factory.mktemp("plp") / "a", build))


@pytest.fixture(scope="module")
def hf(tiny):
    tf = pytest.importorskip("transformers")
    m = tf.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def logprobs(prompt):
        with torch.no_grad():
            return torch.log_softmax(m(torch.tensor([prompt])).logits[0].float(), -1)  # [T, V]
    return logprobs


def check(records, prompt, ref):
    assert len(records) == len(prompt) - 1
    for p, rec in enumerate(records, start=1):
        lp = ref[p - 1]  # the logits after position p-1 score token p
        assert rec["token_id"] == prompt[p]
        assert rec["logprob"] == pytest.approx(float(lp[prompt[p]]), abs=TOL)
        assert rec["rank"] == int((lp >= lp[prompt[p]]).sum())
        top_v, top_i = lp.topk(N)
        assert [i for i, _ in rec["top"]] == top_i.tolist()
        assert [v for _, v in rec["top"]] == pytest.approx(top_v.tolist(), abs=TOL)


def test_prompt_logprobs_equal_hugging_face(model, hf):
    got, _ = generate_ids(model.engine, PROMPTS, 2, prompt_logprobs=N, ignore_eos=True)
    for prompt, r in zip(PROMPTS, got):
        check(r.prompt_logprobs, prompt, hf(prompt))
    plain, _ = generate_ids(model.engine, PROMPTS, 2, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]  # scoring changes no sampled token
    assert all(r.prompt_logprobs is None for r in plain)


class OneRowGraph:
    """A static compiled context graph's contract (Neuron): a callable (not an nn.Module) whose logit_index is
    [1, 1]."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __call__(self, ids, pos, k, v, logit_index, table):
        assert logit_index.shape == (1, 1), logit_index.shape
        self.calls += 1
        return self.module(ids, pos, k, v, logit_index, table)


def test_compiled_graphs_take_one_row_per_call_and_give_the_same_records(model, monkeypatch):
    want, _ = generate_ids(model.engine, PROMPTS[:1], 1, prompt_logprobs=N, ignore_eos=True)
    graphs = dict(model.engine.graphs)
    wrapped = {k: OneRowGraph(g) for k, g in graphs.items() if k.startswith("context")}
    monkeypatch.setattr(model.engine, "graphs", {**graphs, **wrapped})
    got, _ = generate_ids(model.engine, PROMPTS[:1], 1, prompt_logprobs=N, ignore_eos=True)
    assert sum(g.calls for g in wrapped.values()) == len(PROMPTS[0])  # one call per position
    for a, b in zip(got[0].prompt_logprobs, want[0].prompt_logprobs, strict=True):
        assert a["token_id"] == b["token_id"] and a["rank"] == b["rank"]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-6)  # same graph, same inputs
    assert got[0].token_ids == want[0].token_ids


def test_chunked_prefill_and_prefix_cache_keep_every_record(model, hf):
    runner = SlotRunner(model.engine, options=RunOptions())
    prompt = PROMPTS[0]
    runner.join("a", prompt, model_sampling(), blocks=[1, 2, 3], prompt_logprobs=2)
    assert runner.encode({"a": 5}) == {"a": []} and runner.encode({"a": 13}) == {"a": []}
    first = runner.encode({"a": len(prompt)})["a"]
    records = runner.take_prompt_logprobs("a")
    assert len(first) == 1 and runner.take_prompt_logprobs("a") is None  # handed out once
    ref = hf(prompt)
    assert [r["token_id"] for r in records] == prompt[1:]
    assert [r["logprob"] for r in records] == pytest.approx([float(ref[p - 1, prompt[p]])
                                                            for p in range(1, len(prompt))], abs=TOL)
    runner.release("a")
    # the runtime's own prefix cache is not read for a scored prompt: a repeat still scores every position
    twice, _ = generate_ids(model.engine, [prompt, prompt], 1, prompt_logprobs=1, ignore_eos=True,
                            options=RunOptions(prefix_caching=True))
    assert [len(r.prompt_logprobs) for r in twice] == [len(prompt) - 1] * 2


def model_sampling():
    return SamplingConfig()
