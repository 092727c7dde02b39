"""Sample logprobs through the real vLLM (offline `LLM.generate`, `SamplingParams.logprobs=k`) against Hugging Face
transformers on the same tiny fp32 checkpoint, and against stock vLLM (plugin off) on the same requests.

Reference: HF's logits for prompt + the tokens vLLM returned (one forward pass), log_softmax in fp32 at each
generated position. Tolerance 1e-4 (absolute, logprobs): both sides compute in fp32, but with different kernels and
summation orders (neuron-infer's graphs with a KV cache, one token per step, vs HF's full-sequence forward). The
largest difference measured over every compared entry of these requests (`check_against_hf`'s return value) was
2.4e-6, about 40x below the tolerance, while a wrong position, token or normalisation is off by far more (the tiny
model's logprobs are spread over several nats). Top-k ids and ranks must be equal exactly.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from transformers import LlamaForCausalLM

PROMPTS = [list(range(7, 27)), [5, 9, 33]]
N, K = 12, 5
TOL = 1e-4

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompts, n, k, plugin = (sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]),
                                           int(sys.argv[5]), sys.argv[6] == "1")
    extra = {"additional_config": {"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache}} if plugin else {}
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0, max_logprobs=-1, **extra)

    def run(params):  # one generate call: the requests share steps (different k per row in one step)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in params], [sp for _, sp in params])
        res = []
        for o in outs:
            c = o.outputs[0]
            lps = None if c.logprobs is None else [
                {str(t): [lp.logprob, lp.rank] for t, lp in pos.items()} for pos in c.logprobs]
            res.append({"ids": list(c.token_ids), "logprobs": lps, "cumulative": c.cumulative_logprob})
        return res

    greedy = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=k)) for p in prompts]
    mixed = greedy + [
        (prompts[0], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)),  # no logprobs, same steps
        (prompts[1], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)),
    ]
    res = {"mixed": run(mixed)}
    res["sampled"] = run([(prompts[0], SamplingParams(temperature=1.0, seed=5, max_tokens=n, ignore_eos=True,
                                                      logprobs=2))])
    res["vocab"] = run([(prompts[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=-1))])
    try:
        llm.generate(["hi"], SamplingParams(max_tokens=2, prompt_logprobs=1))
        res["prompt_logprobs_error"] = None
    except Exception as e:
        res["prompt_logprobs_error"] = f"{type(e).__name__}: {e}"
    print("RESULT:" + json.dumps(res), flush=True)
"""


def vllm_run(tiny, cache, plugin: bool) -> dict:
    return run_script(SCRIPT, [str(tiny), str(cache), json.dumps(PROMPTS), str(N), str(K), "1" if plugin else "0"],
                      timeout=420, NEURON_INFER_VLLM="1" if plugin else "0")


@pytest.fixture(scope="module")
def plugin(tiny, tmp_path_factory):
    return vllm_run(tiny, tmp_path_factory.mktemp("cache"), plugin=True)


@pytest.fixture(scope="module")
def hf(tiny):
    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
        """[len(output), V]: HF's log_softmax at each position that generated an output token."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0]  # [T, V]
        return torch.log_softmax(logits.float(), -1)[len(prompt) - 1: len(prompt) - 1 + len(output)]

    return logprobs


def check_against_hf(got: dict, ref: torch.Tensor, k: int) -> float:
    """One request's vLLM logprobs vs HF's [n, V]; returns the largest absolute difference seen."""
    assert got["logprobs"] is not None and len(got["logprobs"]) == len(got["ids"]) == ref.shape[0]
    worst = 0.0
    for tok, pos, lp in zip(got["ids"], got["logprobs"], ref):
        entries = {int(t): v for t, v in pos.items()}
        top_v, top_i = lp.topk(k) if k else (lp[:0], torch.zeros(0, dtype=torch.long))
        assert set(entries) == {tok, *top_i.tolist()}  # the sampled token always, plus the top k
        assert entries[tok][1] == int((lp >= lp[tok]).sum())  # its rank
        for rank, (i, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), start=1):
            assert entries[i][1] == rank
            assert entries[i][0] == pytest.approx(v, abs=TOL)
        assert entries[tok][0] == pytest.approx(float(lp[tok]), abs=TOL)
        worst = max(worst, max(abs(v - float(lp[t])) for t, (v, _) in entries.items()))
    assert got["cumulative"] == pytest.approx(sum(pos[str(t)][0] for t, pos in zip(got["ids"], got["logprobs"])),
                                              abs=1e-3)
    return worst


def test_greedy_logprobs_equal_hf(plugin, hf):
    mixed = plugin["mixed"]
    for prompt, got in zip(PROMPTS, mixed[:2]):
        assert len(got["ids"]) == N
        check_against_hf(got, hf(prompt, got["ids"]), K)
        assert all(pos[str(t)][1] == 1 for t, pos in zip(got["ids"], got["logprobs"]))  # greedy: rank 1
    assert mixed[2]["logprobs"] is None and mixed[2]["ids"] == mixed[0]["ids"]
    check_against_hf(mixed[3], hf(PROMPTS[1], mixed[3]["ids"]), 0)  # logprobs=0: the sampled token alone
    assert all(len(pos) == 1 for pos in mixed[3]["logprobs"])


def test_sampled_token_logprob_and_rank(plugin, hf):
    (got,) = plugin["sampled"]
    check_against_hf(got, hf(PROMPTS[0], got["ids"]), 2)
    ranks = [pos[str(t)][1] for t, pos in zip(got["ids"], got["logprobs"])]
    assert max(ranks) > 1  # temperature 1 on spread-out logits draws tokens outside the top 1: really sampled


def test_whole_vocabulary_logprobs(plugin, hf, tiny):
    (got,) = plugin["vocab"]
    vocab = LlamaForCausalLM.config_class.from_pretrained(tiny).vocab_size
    assert all(len(pos) == vocab for pos in got["logprobs"])
    check_against_hf(got, hf(PROMPTS[1], got["ids"]), vocab)


def test_prompt_logprobs_are_served(plugin):
    assert plugin["prompt_logprobs_error"] is None


@pytest.mark.slow
def test_same_format_and_values_as_stock_vllm(plugin, tiny, tmp_path_factory):
    """Stock vLLM (plugin off, its own CPU model runner) on the same requests: same tokens, same logprob entries
    (ids and ranks), values within TOL."""
    stock = vllm_run(tiny, tmp_path_factory.mktemp("stock"), plugin=False)
    assert stock["prompt_logprobs_error"] is None
    for part in ("mixed", "vocab"):  # greedy requests (vLLM samples with other random draws than neuron-infer)
        for ours, theirs in zip(plugin[part], stock[part], strict=True):
            assert ours["ids"] == theirs["ids"], part
            if theirs["logprobs"] is None:
                assert ours["logprobs"] is None
                continue
            for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True):
                assert a.keys() == b.keys() and all(a[t][1] == b[t][1] for t in a)
                assert [a[t][0] for t in a] == pytest.approx([b[t][0] for t in a], abs=TOL)
