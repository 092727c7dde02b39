"""The embedded SmolLM2-135M through vLLM + the plugin (slow): greedy tokens == neuron-infer == Hugging Face (fp32).

fp32 with eager graphs so the three implementations are compared on the same arithmetic (bf16 rounding differs
between HF, vLLM and our graphs and could flip a near-tie); the artifact is compiled by the plugin on first use.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from transformers import LlamaForCausalLM

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig
from neuron_infer.embedded import default_model_dir

PROMPT = "The capital of France is"
N = 16
SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cache, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    llm = LLM(model=model, dtype="float32", max_model_len=128, max_num_seqs=2, gpu_memory_utilization=0.3,
              enforce_eager=True, seed=0,
              additional_config={"neuron_infer_backend": "cpu-eager", "neuron_infer_cache_dir": cache})
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    print("RESULT:" + json.dumps({"prompt_ids": out.prompt_token_ids, "ids": out.outputs[0].token_ids,
                                  "text": out.outputs[0].text}), flush=True)
"""


@pytest.mark.slow
def test_smollm2_greedy_equals_neuron_infer_and_hf(tmp_path):
    model = default_model_dir()
    got = run_script(SCRIPT, [str(model), str(tmp_path / "cache"), PROMPT, str(N)], timeout=600)
    build = BuildConfig(dtype="fp32", batch_size=1, max_context_length=128, max_length=128)
    compile_model(model, tmp_path / "ref", build, backend="cpu-eager", say=lambda m: None)
    ours = CompiledModel.load(tmp_path / "ref")
    assert got["prompt_ids"] == ours.encode(PROMPT)
    assert got["ids"] == ours.generate_ids([got["prompt_ids"]], N, ignore_eos=True).outputs[0].token_ids
    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([got["prompt_ids"]])
    ref = hf.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got["ids"] == ref[0, ids.shape[1]:].tolist()
    assert got["text"].startswith(" Paris"), json.dumps(got["text"])
