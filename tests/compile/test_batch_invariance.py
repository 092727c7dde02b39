"""Batch invariance: a row's result does not depend on the other rows computed with it, bit for bit.

Speculative decoding's greedy output equals plain decoding only if the verify pass over K+1 tokens computes, for
each token, exactly the logits a one-token step computes there: in bf16 a difference in the last bit flips near-ties
(docs/cpu-backend.md, "Batch invariance"). Checked with torch.equal, no tolerance:
* the GEMV kernels (bf16, int8 weights, w8a8) at every ISA level this CPU has: the same weights on the first r of
  8 input rows, r = 1..8, give the same bits in every row (K with a tail, N leaving single columns); the attention
  kernel's rows are checked in test_cpu_attention.py;
* whole compiled steps: six one-token steps against one 6-token pass over the same tokens and cache (the logits of
  every token and the KV cache written), for a tiny GQA model (3 query heads per KV head, so 18 folded query rows;
  head dim 32, so attention runs the attention kernel)
  in bf16 at every ISA level and with int8 and w8a8 weights at the best one, and for the first 5 layers of the
  embedded SmolLM2-135M-Instruct in bf16, with its layers unrolled and as one loop (test_layer_loop.py): its real
  activations showed a residual sum that one graph rounded to bf16
  before an RMSNorm read it and the other did not (Inductor fused them differently; backends/cpu/graph.py makes it round every
  bf16 op's result as eager does), which the random-weight models did not show.
Each compiled graph runs in its own process (fresh_process.py: libraries of different ISA levels export the same
symbols).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import ModelConfig, QuantConfig
from neuron_infer.embedded import default_model_dir
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.model.ops import Ops
from neuron_infer.quant import apply_quantization
from neuron_infer.quant.int8 import Int8Linear
from neuron_infer.quant.smoothquant import W8A8Linear
from tests.compile.fresh_process import run_check
from tests.compile.test_cpu_backend import tiny_model
from tests.compile.test_layer_loop import restacked

# ISA levels per kernel (a level the CPU lacks is skipped; the VNNI levels build the bf16 kernel as the level below)
KERNEL_ISAS = {"bf16": ("avx512-bf16", "avx512", "avx2"), "int8": ("avx512-vnni", "avx512", "avx2-vnni", "avx2"),
               "w8a8": ("avx512-vnni", "avx512", "avx2-vnni", "avx2")}
CASES = [(kind, isa) for kind, isas in KERNEL_ISAS.items() for isa in isas if cpu_gemv.has_isa(isa)]
needs_kernel = pytest.mark.skipif(not cpu_gemv.supported(), reason="this CPU has no AVX2 + FMA")
ROWS, N, K = 8, 37, 200  # K: 6 whole 32-blocks and a tail of 8; N: 37 = 9 groups of 4 + 1, 12 of 3 + 1, 18 of 2 + 1
EDGE = 8  # rows_input's large values: the first and the last EDGE elements


class SameWeightsOnFirstRows(torch.nn.Module):
    """One linear (bf16, or quantized by `scheme`) applied to x[:r] for r = 1..8: eight kernel calls of r rows."""

    def __init__(self, scheme: str):
        super().__init__()
        torch.manual_seed(0)
        lin = torch.nn.Linear(K, N, bias=False).to(torch.bfloat16)
        with torch.no_grad():  # O(1) weights (products of the size of an fp32 step at 2^24), 1 at the edges
            lin.weight.copy_(torch.randn(N, K))
            lin.weight[:, :EDGE] = lin.weight[:, K - EDGE:] = 1.0  # the weights of rows_input's cancelling pairs
        self.lin = {"bf16": lin, "int8": Int8Linear.from_linear(lin), "w8a8": W8A8Linear.from_linear(lin)}[scheme]
        self.ops = Ops(name="reference")  # the CPU backend traces with its table: kernel calls

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [8, K] -> 8 results [r, N]
        return tuple(self.ops.linear(self.lin, x[:r]) for r in range(1, ROWS + 1))


def rows_input() -> torch.Tensor:
    """[8, K]: O(1) values, +2^24 at the first EDGE elements and -2^24 at the last EDGE, which meet equal weights in
    every column (SameWeightsOnFirstRows) and cancel in exact arithmetic. Every product summed into an fp32
    accumulator holding one of them loses its low bits, so two summation orders give visibly different results; with
    same-scale inputs they would mostly agree after the bf16 rounding and the test could not tell the orders apart."""
    torch.manual_seed(1)
    x = torch.randn(ROWS, K)
    x[:, :EDGE], x[:, K - EDGE:] = 2.0**24, -(2.0**24)
    return x.to(torch.bfloat16)


def check_rows(out: str, scheme: str) -> None:
    """Every row of every call equals the same row of the 8-row call (run in a fresh process)."""
    module = SameWeightsOnFirstRows(scheme).eval()
    graph = CpuBackend().load_graph(Path(out), "rows", module)
    with torch.inference_mode():
        results = graph(rows_input())
    full = results[-1]  # [8, N]
    for r, got in enumerate(results, start=1):
        assert torch.equal(got, full[:r]), f"{r} rows: {(got.float() - full[:r].float()).abs().max().item()}"


@needs_kernel
@pytest.mark.parametrize("scheme, isa", CASES)
def test_gemv_kernels_give_each_row_the_same_bits_whatever_the_row_count(tmp_path, scheme, isa):
    module = SameWeightsOnFirstRows(scheme).eval()
    with torch.inference_mode():
        meta = CpuBackend(CpuCompileOptions(gemv_isa=isa)).compile_graph(module, (rows_input(),), tmp_path, "rows")
    assert meta["gemv_kernel"]
    run_check("tests.compile.test_batch_invariance", "check_rows", str(tmp_path), scheme)


# ---- whole steps ---------------------------------------------------------------------------------------------------
GQA = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "hidden_size": 576}  # G = 3; the attention kernel's D
S, BS, P0, T = 32, 8, 11, 6  # attend bucket, block size, first new position, verify tokens (K = 5 drafts)


def step_model(model: str) -> BucketStep:
    """"bf16" | "int8" | "w8a8": the tiny GQA model in bf16 (embeddings scaled to O(100), a residual stream as large
    as real models'), its linears quantized by the scheme; "smollm2": the first SMOLLM2_LAYERS layers of the embedded
    SmolLM2-135M-Instruct in bf16, whose real activations (|x| up to ~150, where a bf16 step is 1) expose a value
    that is rounded in one graph and not in the other (a residual sum read by an RMSNorm), which random weights did
    not."""
    if model.endswith("-looped"):  # weights laid out as the runtime loads them: the layers run as one loop
        step = step_model(model.removesuffix("-looped"))
        restacked(step.model)
        return step
    if model == "smollm2":
        return BucketStep(smollm2_layers(SMOLLM2_LAYERS), S)
    tiny = tiny_model(**GQA)
    with torch.no_grad():
        tiny.model.embed_tokens.weight.mul_(300.0)
    tiny = tiny.to(torch.bfloat16)
    if model != "bf16":
        apply_quantization(tiny, QuantConfig(scheme=model))
    return BucketStep(tiny, S)


SMOLLM2_LAYERS = 5


def smollm2_layers(n: int) -> LlamaModel:
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    model = LlamaModel(dataclasses.replace(cfg, num_layers=n))
    state = load_checkpoint(d, cfg)
    missing = model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)
    assert missing.missing_keys == ["lm_head.weight"] and cfg.tie_word_embeddings  # the head is the embedding
    model.tie_weights()
    return model.to(torch.bfloat16).eval()


def start_cache(step: BucketStep) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache whose positions < P0 hold seeded values (the prompt), in blocks 1..S/BS of a 6-block cache."""
    c = step.model.cfg
    torch.manual_seed(2)
    shape = (c.num_layers, 2 + S // BS, c.num_kv_heads, BS, c.head_dim)  # [L, N, Hkv, bs, D]
    return (torch.randn(shape) * 0.5).to(torch.bfloat16), (torch.randn(shape) * 0.5).to(torch.bfloat16)


TOKENS = torch.tensor([[5, 91, 17, 230, 64, 3]])  # [1, T]: the last pending token and 5 drafts


def args(k, v, first: int, count: int) -> tuple:
    """count tokens from TOKENS[first] at positions P0 + first.., logits at each."""
    ids = TOKENS[:, first: first + count]  # [1, count]
    pos = torch.arange(P0 + first, P0 + first + count).view(1, count)  # [1, count]
    return ids, pos, k, v, torch.arange(count).view(1, count), torch.arange(1, 1 + S // BS).view(1, -1)


def check_steps(out: str, model: str) -> None:
    """T one-token steps vs one T-token pass: the logits of every token and the cache, bit for bit."""
    step = step_model(model)
    one, many = (CpuBackend().load_graph(Path(out), name, step) for name in ("t1", f"t{T}"))
    with torch.inference_mode():
        k1, v1 = start_cache(step)
        singles = [one(*args(k1, v1, i, 1))[0, 0] for i in range(T)]  # T x [V]
        kt, vt = start_cache(step)
        verify = many(*args(kt, vt, 0, T))[0]  # [T, V]
    for i, logits in enumerate(singles):
        assert torch.equal(verify[i], logits), f"token {i}: {(verify[i] - logits).abs().max().item()}"
    assert torch.equal(k1, kt) and torch.equal(v1, vt)


STEP_CASES = [("bf16", isa) for isa in KERNEL_ISAS["bf16"] if cpu_gemv.has_isa(isa)]
STEP_CASES += [(model, "auto") for model in ("int8", "w8a8", "smollm2", "smollm2-looped")]


@needs_kernel
@pytest.mark.parametrize("model, isa", STEP_CASES)
def test_a_verify_pass_computes_what_one_token_steps_compute(tmp_path, model, isa):
    step = step_model(model)
    backend = CpuBackend(CpuCompileOptions(gemv_isa=isa))
    with torch.inference_mode():
        for name, count in (("t1", 1), (f"t{T}", T)):
            k, v = start_cache(step)
            assert backend.compile_graph(step, args(k, v, 0, count), tmp_path, name)["gemv_kernel"]
            # a looped graph binds the stacked layer weights, an unrolled one each layer's
            assert ("layer_stack" in (tmp_path / f"{name}.json").read_text()) == model.endswith("-looped")
    run_check("tests.compile.test_batch_invariance", "check_steps", str(tmp_path), model)
