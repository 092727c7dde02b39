"""The CPU backend's op table (backends/cpu/ops.py): the one way kernels enter a CPU graph.

Checked on exported programs (no AOTInductor compile: seconds): which kernel call each module on each row count
becomes, that the traced program computes what the module computes, and that the model keeps its own table. The
kernels' numerics against their references are test_cpu_gemv*.py's and test_cpu_attention.py's.
Tolerances: a traced bf16 program differs from the eager module by the kernel's single rounding vs the GEMM's (one
bf16 step of the output, 2^-8 relative); fp32 by reassociation (1e-5).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels
from neuron_infer.backends.cpu.graph import CpuCompileOptions
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.ops import Ops, attention_ref
from neuron_infer.quant.fp8 import FP8Linear
from neuron_infer.quant.int8 import Int8Linear
from tests.compile.test_cpu_backend import empty_cache, tg_args, tiny_model

needs_kernel = pytest.mark.skipif(not kernels.supported(), reason="this CPU has no AVX2 + FMA")
aten = torch.ops.aten


class One(nn.Module):
    """One projection applied through an op table, as the model applies every projection."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj, self.ops = proj, Ops(name="reference")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.proj, x)


def traced(module: nn.Module, x: torch.Tensor, **options) -> tuple[list, torch.Tensor]:
    """The call targets of `module` exported by the CPU backend, and the program's result on x."""
    program = cpu._export(module, (x,), CpuCompileOptions(**options))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    with torch.inference_mode():
        return targets, program.module()(x)


def linear(dtype: torch.dtype, n: int = 48, k: int = 64) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=True).to(dtype).eval()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_bf16_linear_on_few_rows_is_the_bf16_kernel(rows):
    mod = One(linear(torch.bfloat16))
    x = torch.randn(rows, 64).to(torch.bfloat16)
    targets, got = traced(mod, x)
    assert targets.count(kernels.OPS["bf16"]) == 1 and aten.addmm.default not in targets
    torch.testing.assert_close(got, mod(x), atol=0.02, rtol=2**-7)  # one bf16 rounding each


@needs_kernel
def test_int8_module_on_bf16_rows_is_the_int8_kernel_and_on_fp32_rows_its_forward_as_reductions():
    q8 = Int8Linear.from_linear(linear(torch.bfloat16))
    x = torch.randn(3, 64).to(torch.bfloat16)
    targets, got = traced(One(q8), x)
    assert targets.count(kernels.OPS["int8"]) == 1 and kernels.OPS["bf16"] not in targets
    torch.testing.assert_close(got, q8(x), atol=0.02, rtol=2**-7)
    q32 = Int8Linear.from_linear(linear(torch.float32))
    x32 = torch.randn(1, 64)
    targets, got = traced(One(q32), x32)
    assert not set(kernels.OPS.values()) & set(targets)
    assert aten.mm.default not in targets and aten.addmm.default not in targets  # a reduction, not the GEMM
    torch.testing.assert_close(got, q32(x32), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_scheme_forward_matmul_on_bf16_rows_is_the_bf16_kernel():
    """FP8Linear's forward is F.linear on its dequantized weight: traced inside the op table's linear, that matmul is
    the bf16 kernel, on few rows (its GEMV) and on more (its GEMM)."""
    fp8 = FP8Linear.from_linear(linear(torch.bfloat16))
    for rows, kernel_calls in ((2, 1), (9, 1)):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        targets, got = traced(One(fp8), x)
        assert targets.count(kernels.OPS["bf16"]) == kernel_calls, rows
        torch.testing.assert_close(got, fp8(x), atol=0.02, rtol=2**-7)


def test_without_kernels_fp32_few_rows_are_reductions_and_gemv_max_rows_0_keeps_the_gemm():
    mod, x = One(linear(torch.float32)), torch.randn(2, 64)
    targets, got = traced(mod, x)
    assert aten.addmm.default not in targets and aten.mm.default not in targets
    torch.testing.assert_close(got, mod(x), atol=1e-5, rtol=1e-5)
    targets, got = traced(mod, x, gemv_max_rows=0)
    assert aten.addmm.default in targets or aten.linear.default in targets
    torch.testing.assert_close(got, mod(x), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_model_is_traced_with_the_cpu_table_and_keeps_its_own():
    """A bf16 decode step of the tiny model: its linears are kernel calls (q/k/v and gate/up merged) and its
    attention the attention kernel; afterwards every submodule holds the model's reference table again."""
    model = tiny_model(head_dim=32).to(torch.bfloat16)  # a head dim the attention kernel takes
    before = {id(m): m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), Ops)}
    k, v = (c.to(torch.bfloat16) for c in empty_cache(model))
    program = cpu._export(BucketStep(model, 32), tg_args(k, v, 0), CpuCompileOptions())
    targets = [n.target for n in program.graph.nodes]
    layers = model.cfg.num_layers
    assert targets.count(kernels.KERNEL_OPS["attn"]) == layers
    assert targets.count(kernels.OPS["bf16"]) == 4 * layers + 1  # qkv, o, gate+up, down per layer; the head
    after = {id(m): m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), Ops)}
    assert after == before and all(t.attention is attention_ref for t in after.values())
