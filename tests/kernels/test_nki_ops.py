"""`kernels="nki"` op table: each op vs the reference op, and a tiny Llama end to end on the simulator.

Tolerances: fp32 ops run the kernels in fp32 (fp32 PSUM, fp32 softmax statistics), so they agree with the
PyTorch fp32 reference to rounding (asserted at 2e-5 absolute on O(1) values). bf16 / FP8 ops: see conftest.TOL.
End to end (fp32): logits within 2e-4 absolute of kernels="reference" (per-op differences of ~1e-6 grow
through 2 layers and the LM head to ~1e-5; 2e-4 is still 100x below any real bug, which moves logits by >1e-2)
and identical greedy tokens.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.model import nki_ops
from neuron_infer.model.op_tables import get_ops
from neuron_infer.model.ops import mlp_ref, sequence_attention
from neuron_infer.quant.fp8 import FP8Linear
from tests.paged import as_blocks

from .conftest import check


def _qkv(gen, b, hq, hkv, t, s, d, dtype=torch.float32):
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    return q, k, v


def test_nki_op_table_is_selected_by_kernels():
    ops = get_ops("nki")
    assert ops.name == "nki" and ops.attention is nki_ops.attention and ops.mlp is nki_ops.mlp


@pytest.mark.parametrize("case", ["prefill", "decode", "spec", "tp_padding"])
def test_attention_op_matches_reference(case):
    gen = torch.Generator().manual_seed(0)
    if case == "prefill":        # positions 0..T-1 with a longer cache (attend_len > T): prefill kernel
        q, k, v = _qkv(gen, 2, 4, 2, 20, 32, 16)
        pos, q_to_kv = torch.arange(20).expand(2, 20), torch.tensor([0, 0, 1, 1])
    elif case == "decode":       # one token per row at different positions: decode kernel
        q, k, v = _qkv(gen, 3, 6, 2, 1, 40, 16)
        pos, q_to_kv = torch.tensor([[39], [5], [17]]), torch.tensor([0, 0, 0, 1, 1, 1])
    elif case == "spec":         # k = 3 speculative tokens, 8 query heads per KV head
        q, k, v = _qkv(gen, 2, 8, 1, 3, 50, 16)
        pos, q_to_kv = torch.tensor([[10, 11, 12], [47, 48, 49]]), torch.zeros(8, dtype=torch.long)
    else:                        # non-uniform grouping (replicated KV head under tensor parallelism)
        q, k, v = _qkv(gen, 1, 3, 2, 12, 12, 16)
        pos, q_to_kv = torch.arange(12).view(1, 12), torch.tensor([0, 0, 1])
    kc, vc, table = as_blocks(k, v, math.gcd(k.shape[2], 8))  # the cache as the model holds it: shuffled blocks
    out = nki_ops.attention(q, kc, vc, table, q_to_kv, pos)
    ref = sequence_attention(q, k, v, q_to_kv, pos)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def _linears(gen, hidden, inter, bias=False):
    mods = (nn.Linear(hidden, inter, bias=bias), nn.Linear(hidden, inter, bias=bias), nn.Linear(inter, hidden, bias=bias))
    with torch.no_grad():
        for m in mods:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.in_features ** 0.5)
    return mods


def test_mlp_op_float_matches_reference():
    gen = torch.Generator().manual_seed(1)
    mods = _linears(gen, 96, 200)
    x = torch.randn(2, 5, 96, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(nki_ops.mlp(x, *mods), mlp_ref(x, *mods), atol=2e-5, rtol=2e-5)


def test_mlp_op_fp8_matches_reference():
    gen = torch.Generator().manual_seed(2)
    mods = tuple(FP8Linear.from_linear(m.to(torch.bfloat16)) for m in _linears(gen, 128, 256))
    x = torch.randn(1, 7, 128, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out, ref = nki_ops.mlp(x, *mods), mlp_ref(x, *mods)
    # the reference rounds x @ W to bf16 before the scale; the kernel scales in fp32: bf16-level agreement
    check(out.float().numpy(), ref.double().numpy(), "bf16")


def test_mlp_op_falls_back_for_biased_linears():
    gen = torch.Generator().manual_seed(3)
    mods = _linears(gen, 32, 64, bias=True)
    x = torch.randn(1, 3, 32, generator=gen)
    with torch.no_grad():
        assert torch.equal(nki_ops.mlp(x, *mods), mlp_ref(x, *mods))


def _model(model_dir, kernels):
    cfg = ModelConfig.from_model_dir(model_dir)
    return cfg, build_float_model(cfg, BuildConfig(dtype="fp32", kernels=kernels), load_checkpoint(model_dir, cfg))


def _greedy(model, cfg, prompt, steps, cache_len):
    k = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, cache_len, cfg.head_dim)  # one block of cache_len slots
    v = torch.zeros_like(k)
    table = torch.zeros(1, 1, dtype=torch.long)  # [1, 1]: block 0
    t = prompt.shape[1]
    pos = torch.arange(t).view(1, t)
    logits = [model(prompt, pos, k, v, pos, cache_len, table)]            # [1, T, V]
    tokens = [int(logits[0][0, -1].argmax())]
    for i in range(steps):
        step = model(torch.tensor([[tokens[-1]]]), torch.tensor([[t + i]]), k, v,
                     torch.zeros(1, 1, dtype=torch.long), cache_len, table)
        logits.append(step)
        tokens.append(int(step[0, -1].argmax()))
    return logits, tokens


def test_tiny_llama_end_to_end_nki_equals_reference(tiny_dirs):
    model_dir = tiny_dirs("gqa")
    cfg, ref_model = _model(model_dir, "reference")
    _, nki_model = _model(model_dir, "nki")
    assert nki_model.model.layers[0].mlp.ops.name == "nki"
    prompt = torch.arange(3, 3 + 12).view(1, 12) * 7 % cfg.vocab_size
    with torch.no_grad():
        ref_logits, ref_tokens = _greedy(ref_model, cfg, prompt, 4, 24)
        nki_logits, nki_tokens = _greedy(nki_model, cfg, prompt, 4, 24)
    assert nki_tokens == ref_tokens
    for a, b in zip(nki_logits, ref_logits):
        assert (a - b).abs().max().item() < 2e-4
    assert np.isfinite(torch.cat([x.reshape(-1) for x in nki_logits]).numpy()).all()


def _rel_rms(a, b):
    return float(((a - b) ** 2).mean().sqrt() / (b ** 2).mean().sqrt())


@pytest.mark.parametrize("scheme,mlp_tol", [("mxfp8", 0.07), ("mxfp4", 0.09)])
def test_mx_linear_and_mlp_ops_are_within_mx_error(scheme, mlp_tol):
    """MX modules through the MX matmul kernel (trn3 simulator) vs their PyTorch forward.

    Tolerance (relative RMS): one projection 5% (measured 2.7% MXFP8, 3.0% MXFP4) — the kernel quantizes
    activations to MXFP8 on chip (e4m3: <= 2^-4 relative per element) and re-quantizes the module's weight
    with the hardware block grouping; the MLP stacks three such projections (x and silu(g)*u both quantized):
    7% for MXFP8 (measured 4.5%), 9% for MXFP4 (measured 5.7%; re-grouping 1-mantissa-bit FP4 weights is the
    lossier step). A layout or scale bug gives O(100%).
    """
    from neuron_infer.quant.mx import MXFP4Linear, MXFP8Linear

    cls = MXFP8Linear if scheme == "mxfp8" else MXFP4Linear
    gen = torch.Generator().manual_seed(4)
    lin = [nn.Linear(a, b, bias=False) for a, b in ((200, 96), (200, 96), (96, 200))]
    with torch.no_grad():
        for m in lin:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.in_features ** 0.5)
    mods = tuple(cls.from_linear(m.to(torch.bfloat16)) for m in lin)
    x = torch.randn(2, 3, 200, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        assert _rel_rms(nki_ops.mx_linear(x, mods[0]).float(), mods[0](x).float()) < 0.05
        assert _rel_rms(nki_ops.mlp(x, *mods).float(), mlp_ref(x, *mods).float()) < mlp_tol


@pytest.mark.parametrize("kind", ["float", "fp8"])
def test_mlp_op_consumes_tiled_linears_without_repack(kind):
    """`--weight-tiling` modules (quant.tiled.TiledLinear) feed their buffers to the kernel as they are."""
    from neuron_infer.quant.tiled import TiledLinear

    gen = torch.Generator().manual_seed(5)
    mods = _linears(gen, 160, 200)
    if kind == "fp8":
        mods = tuple(FP8Linear.from_linear(m.to(torch.bfloat16)) for m in mods)
    tiled = tuple(TiledLinear.from_module(m) for m in mods)
    assert nki_ops._kernel_kind(tiled) == "tiled"                   # the kernel path, not the fallback
    x = torch.randn(1, 4, 160, generator=gen).to(torch.bfloat16 if kind == "fp8" else torch.float32)
    with torch.no_grad():
        out, ref = nki_ops.mlp(x, *tiled), mlp_ref(x, *tiled)
    if kind == "float":
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)   # fp32 throughout (see module docstring)
    else:
        check(out.float().numpy(), ref.double().numpy(), "bf16")     # FP8 x bf16: conftest.TOL["bf16"]
