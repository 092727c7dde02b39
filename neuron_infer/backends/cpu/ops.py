"""The CPU backend's op table: where its C kernels (backends/cpu/kernels.py) enter a compiled graph.

A graph is traced with `cpu_ops(table, max_rows, isa)` in place of the model's own table (model.ops.tables_replaced), so
the model, its quantization schemes and its eager runs know nothing of the kernels:

    op          operands (static at export)                              becomes
    linear      quant.int8 Int8Linear, bf16 input, any rows              gemv_int8(x [R, K], [q], [scale])
                quant.smoothquant W8A8Linear, bf16 input, any rows       gemv_w8a8(x, [q], [scale])
                float nn.Linear, bf16, any rows                          gemv_bf16(x, [w])
                float nn.Linear on at most options.gemv_max_rows rows    Inductor-generated fp32 GEMV reductions
                  (fp32, or bf16 where the kernel is not built)
                more rows                                                the GEMM
                any other module (fp8, MX, tiled, int8 on fp32 input)    its own forward, whose F.linear on the
                                                                         dequantized weight is computed as a float
                                                                         linear's (the rows above)
    attention   the reference attention, GQA folded, bf16, any number of  attention(q, k_cache, v_cache, ...)
                query rows (decode, verify, prefill), the kernel's head
                dims
    mlp         the reference SwiGLU                                     its projections through `linear` above

A kernel applies only where the CPU compiling the graph builds it (CpuCompileOptions.kernel_isa). After export,
kernel calls that read the same input are merged into one (backends/cpu/gemv_groups.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from neuron_infer.backends.cpu import kernels
from neuron_infer.model.ops import Ops, attention_ref, computed_once
from neuron_infer.shapes import known

Linear = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def cpu_ops(table: Ops, max_rows: int, isa: str | None) -> Ops:
    """`table` with the CPU backend's linear (and, for the reference attention, its attention) for graphs whose C
    kernels are built for `isa` (None: no kernel) and whose float GEMVs on at most `max_rows` rows are reductions."""
    available = kernels.kernels_for(isa)
    linear = cpu_linear(max_rows, available)
    if table.attention is attention_ref and "attn" in available:
        return replace(table, linear=linear, attention=attention, loop_layers=True)
    return replace(table, linear=linear, loop_layers=True)


def cpu_linear(max_rows: int, available: tuple[str, ...]) -> Linear:
    """The linear op: int8 and w8a8 modules on bf16 rows through their C kernels; float linears through
    `float_linear`; other modules through their own forward, whose float matmul (F.linear on dequantized weights:
    fp8, MX, tiled, int8 on fp32 activations) is computed as `float_linear` computes a float linear."""
    float_linear = float_linear_op(max_rows, "bf16" in available)

    def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]  # dynamic in a prefill graph
        kind = _quantized_kernel(module, x)
        if kind in available:
            return _kernel_linear(kind, module, x, rows)
        if type(module) is nn.Linear:
            return float_linear(x, module.weight, module.bias)
        with _FloatMatmuls(float_linear):
            return module(x)

    return linear


def float_linear_op(max_rows: int, kernel: bool) -> Callable[..., torch.Tensor]:
    """F.linear(x, weight, bias) as a graph computes it: the bf16 C kernel for bf16 operands (`kernel`: built here;
    any row count, the kernel picks its GEMV, GEMM blocks or ATen's GEMM by the rows of each call), else fp32 GEMV
    reductions on at most max_rows rows, else the GEMM."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if kernel and x.dtype == weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            x2 = x.reshape(rows, x.shape[-1]).contiguous()  # [R, K]; a copy only for computed views
            y = kernels.gemv_bf16(x2, [weight.contiguous()]).view(*x.shape[:-1], weight.shape[0])  # [..., N]
            return y if bias is None else y + bias
        # one reduction per row: only for a row count fixed for the graph (a dynamic one, even if bounded by
        # max_rows, would be specialised to the example's by the loop over rows)
        if max_rows and isinstance(rows, int) and rows <= max_rows:
            return gemv_reductions(x, weight, bias, rows)
        if bias is None or x.dim() == 2:
            return F.linear(x, weight, bias)
        # F.linear's own flattening (C++) sizes the flattened rows with the example's value inside a while_loop
        # body (the looped layer stack), so it is written out: the same addmm on the same [R, K] rows
        y = torch.addmm(bias, x.reshape(rows, x.shape[-1]), weight.t())  # [R, N]
        return y.view(*x.shape[:-1], weight.shape[0])  # [..., N]

    return linear


class _FloatMatmuls(TorchFunctionMode):
    """While active, F.linear calls are computed by `linear` (a quantized scheme's matmul on its dequantized
    weight, traced inside the op table's linear)."""

    def __init__(self, linear: Callable[..., torch.Tensor]):
        super().__init__()
        self.linear = linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return self.linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _quantized_kernel(module: nn.Module, x: torch.Tensor) -> str | None:
    """Which quantized C GEMV kernel computes `module` on x ("int8", "w8a8"), from static dtypes and types only."""
    if x.dtype != torch.bfloat16 or module.weight.device.type != "cpu":
        return None
    scheme = getattr(module, "scheme", None)
    return scheme if scheme in ("int8", "w8a8") else None


def _kernel_linear(kind: str, module: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """module(x) through the int8 or w8a8 C kernel: x [..., K] -> [..., N] bf16."""
    x2 = x.reshape(rows, x.shape[-1]).contiguous()  # [R, K]; contiguous() is a copy only for computed views
    gemv = kernels.gemv_int8 if kind == "int8" else kernels.gemv_w8a8
    y = gemv(x2, [module.weight], [module.weight_scale])  # [R, N] bf16
    if module.bias is not None:
        y = y + module.bias.to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])  # [..., N]


def gemv_reductions(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for a few rows as fp32 multiply-and-sum reductions that Inductor turns into one
    vectorised, row-parallel pass over the weights (each weight row read once for all rows)."""
    if known(rows == 1):
        # [..., 1, K] * [N, K] -> sum over K -> [..., N]; accumulate in fp32 like the GEMM does. The input is
        # computed once into an fp32 buffer, so the loop over the weights does not redo its producer (RMSNorm,
        # residual add) and its bf16 -> fp32 conversion for every output row.
        y = (computed_once(x.float()).unsqueeze(-2) * weight.float()).sum(-1).to(x.dtype)
    else:
        # One reduction per row over the same weight: Inductor fuses reductions with identical loops, so each
        # weight row is read once for all rows (x [R, K] * w [N, K] broadcast as one [R, N, K] product would
        # loop over R outside and stream the weights R times).
        xr, wf = computed_once(x.reshape(rows, x.shape[-1]).float()), weight.float()  # [R, K], [N, K]
        y = torch.stack([(wf * xr[r]).sum(-1) for r in range(rows)])  # [R, N]
        y = y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def attention(q, k_cache, v_cache, table, q_to_kv, positions):
    """The reference attention's signature; GQA-folded bf16 attention through the C kernel (which reads the block
    caches in place and skips the keys past each row's position), everything else through the reference."""
    if q_to_kv is None and kernels.attention_fits(q, k_cache, v_cache):
        return kernels.attention(q, k_cache, v_cache, table, positions)  # [B, H, R, D]
    return attention_ref(q, k_cache, v_cache, table, q_to_kv, positions)
