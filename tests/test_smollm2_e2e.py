"""End to end on the embedded SmolLM2-135M-Instruct (slow: conversion ~25 s, compile of its graphs).

fp32: greedy tokens from the compiled artifact equal Hugging Face greedy, 64 tokens (exact).
bf16: greedy agreement criterion against HF fp32 — the first 8 generated tokens equal and >= 90% of 64
teacher-forced next-token predictions equal. bf16 rounds weights to 8 mantissa bits; SmolLM2's logit margins are
mostly large but a few positions are near-ties, which may flip (measured: see the assertion messages).
"""
import pytest
import torch
from transformers import LlamaForCausalLM

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig

pytestmark = pytest.mark.slow
BUILD = BuildConfig(dtype="fp32", max_context_length=64, max_length=128, context_buckets=(64,),
                    tokengen_buckets=(128,))


@pytest.fixture(scope="module")
def smollm2_dir():
    from neuron_infer.embedded import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def hf_fp32(smollm2_dir):
    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_fp32_greedy_equals_hf_and_says_paris(smollm2_dir, hf_fp32, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "fp32"
    compile_model(smollm2_dir, out, BUILD, say=lambda m: None)
    m = CompiledModel.load(out)
    ids = m.encode("The capital of France is")
    got = m.generate_ids([ids], 64, ignore_eos=True).outputs[0]
    with torch.inference_mode():
        ref = hf_fp32.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert got.token_ids == ref
    assert got.text.startswith(" Paris.")


def test_bf16_agreement_with_hf_fp32(smollm2_dir, hf_fp32, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "bf16"
    compile_model(smollm2_dir, out, BUILD.replace(dtype="bf16"), say=lambda m: None)
    m = CompiledModel.load(out)
    ids = m.encode("The capital of France is")
    got = m.generate_ids([ids], 64, ignore_eos=True).outputs[0].token_ids
    with torch.inference_mode():
        seq = torch.tensor([ids + got])
        ref_next = hf_fp32(seq).logits[0].argmax(-1)[len(ids) - 1:-1]  # HF's choice at each generated position
    agree = (torch.tensor(got) == ref_next).float().mean().item()
    assert got[:8] == ref_next[:8].tolist(), "first tokens differ from HF fp32"
    assert agree >= 0.90, f"teacher-forced agreement {agree:.2%}"
