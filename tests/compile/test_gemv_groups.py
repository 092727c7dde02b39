"""Merging GEMV calls that read one input (backends/cpu/gemv_groups.py): which calls merge, and that the merged graph
computes the same values. The merged kernels themselves are checked against their references at every ISA level in
test_cpu_gemv*.py (their SHARED linears)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuCompileOptions
from neuron_infer.model.ops import Ops

needs_kernel = pytest.mark.skipif(not cpu_gemv.supported(), reason="this CPU has no AVX2 + FMA")


def lin(n: int, k: int) -> torch.nn.Linear:
    return torch.nn.Linear(k, n, bias=False)  # weight [n, k]


class Block(torch.nn.Module):
    """q/k/v-like and gate/up-like linears on one normed input, a linear on another input, five on a third, applied
    through an op table (the CPU backend traces them with its own: kernel calls)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.ModuleList([lin(48, 32), lin(16, 32), lin(16, 32)])
        self.out = lin(32, 48)
        self.five = torch.nn.ModuleList([lin(8 + i, 32) for i in range(5)])
        self.late = lin(12, 32)
        self.ops = Ops(name="reference")
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xn = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype)  # [B, T, 32]
        q, k, v = (self.ops.linear(lin, xn) for lin in self.qkv)
        o = self.ops.linear(self.out, q)  # reads q, not xn: its own call
        five = [self.ops.linear(lin, h) for lin in self.five]
        # its weight is computed after the q/k/v call: not merged
        late = cpu_gemv.gemv_bf16(xn.reshape(-1, 32), [self.late.weight * 2]).view(*xn.shape[:-1], 12)
        return (o, k + 1, v, late, *five)


def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(rows, 1, 32).to(torch.bfloat16), torch.randn(rows, 32).to(torch.bfloat16)


def calls(program: torch.export.ExportedProgram) -> list[list[int]]:
    """The weight widths of each GEMV call, in graph order."""
    return [[w.meta["val"].shape[0] for w in node.args[1]] for node in program.graph.nodes
            if node.target is cpu_gemv.OPS["bf16"]]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
def test_calls_reading_one_input_merge_up_to_the_cap(rows):
    program = cpu._export(Block().eval(), inputs(rows), CpuCompileOptions())
    assert calls(program) == [[48, 16, 16], [32], [8, 9, 10, 11], [12], [12]]  # q/k/v, out, five (4 + 1), late


def test_the_cap_is_what_the_c_kernels_accept():
    """A merged call of MAX_GROUP matrices must pass the kernels' operand check (kMaxMats), else it would fail at
    run time; the compiled graphs of test_cpu_gemv*.py run calls of exactly MAX_GROUP matrices."""
    header = (Path(cpu_gemv.__file__).parent / "cpu_gemv_common.h").read_text()
    assert re.search(r"constexpr int64_t kMaxMats = (\d+);", header).group(1) == str(cpu_gemv.MAX_GROUP)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
def test_merged_program_computes_what_separate_calls_compute(rows, monkeypatch):
    """The ops' own (reference) implementations run eagerly: the column slices hand each linear its own result."""
    module, xs = Block().eval(), inputs(rows)
    merged = cpu._export(module, xs, CpuCompileOptions())
    monkeypatch.setattr(cpu, "group_gemvs", lambda gm: 0)
    separate = cpu._export(module, xs, CpuCompileOptions())
    assert len(calls(separate)) == 3 + 1 + 5 + 1
    with torch.inference_mode():
        got, want = merged.module()(*xs), separate.module()(*xs)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
