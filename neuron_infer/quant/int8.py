"""INT8 weight-only quantization: symmetric, per output channel, scale = absmax / 127 (TNX 'vector_dynamic').

Stored per linear (HF layout):
  weight        int8  [out, in]   q = clamp(round(w / scale), -127, 127)
  weight_scale  bf16  [out]       absmax/127 rounded *up* to the next bf16, so |w / scale| <= 127 never clips
  bias          act   [out]       optional
Bound: |dequant - w| <= scale / 2 per element (round to nearest; no clipping because the stored scale >= absmax/127).

Forward = the scale is applied after the matmul (as on Neuron): y = (x @ q^T) * scale + bias. Chosen from the
static row count M = prod(x.shape[:-1]) (never from data):
* bf16 inputs, M <= PACK_MAX_ROWS and in % 32 == 0 on CPU: `torch._weight_int8pack_mm` (int8 weights streamed
  straight into the dot, bf16 activations, fp32 accumulate; an fp32 model's activations are not rounded to bf16),
  for a one-row step (eager, and graphs compiled where the C kernel is not built): a decode step is bound by reading
  the weights, and this reads half the bytes of a bf16 weight without a widened copy. It is a GEMV loop (each row
  streams the weights again, so a GEMM wins on many rows), it returns garbage when in % 32 != 0, and AOTInductor
  graphs calling it with 4 rows crashed (torch 2.13), hence one row only;
* otherwise: F.linear(x, q.to(x.dtype)) * scale (prefill, where the GEMM is bound by arithmetic rather than by the
  weight bytes; tails; every non-CPU device, where e.g. the Neuron compiler sees TNX's "int8 weight, dequantize
  after the matmul" pattern).
In graphs the CPU backend compiles, its op table (backends/cpu/ops.py) gives int8 linears on bf16 rows to the C
kernel backends/cpu/cpu_gemv_int8.cpp instead: on 1-8 rows (decode, batched decode, speculative verification) it
streams the int8 weights once for all rows; on more (prefill) it computes int8 x int16 dot products in blocks of rows
that share each weight block while it is in cache, with no widened copy of the weights.
Measured speeds of the kernel path: docs/performance.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.quant.base import QuantizedLinear, check_float_linear, per_channel_absmax
from neuron_infer.shapes import known

QMAX = 127
PACK_MAX_ROWS = 1  # one row only: AOTInductor graphs calling it with 4 rows at SmolLM2 sizes crash (segfault, torch
# 2.13; reproduced with a 2-layer SmolLM2-shaped int8 model, batch-4 decode); at 4+ rows it was no faster than bf16
PACK_K_MULTIPLE = 32  # torch._weight_int8pack_mm is only correct for in_features % 32 == 0



def round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Positive float32 -> the smallest bf16 >= s (so a stored bf16 scale never shrinks the range)."""
    b = s.to(torch.bfloat16)  # round to nearest even
    bits = b.view(torch.int16)
    bumped = (bits + 1).view(torch.bfloat16)  # next bf16 toward +inf (s > 0)
    return torch.where(b.float() < s, bumped, b)


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales [out] (bf16, rounded up); all-zero rows get the smallest normal (q stays 0)."""
    s = per_channel_absmax(weight) / QMAX
    s = s.clamp_min(torch.finfo(torch.bfloat16).tiny)
    return round_up_bf16(s)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bf16 scale [out])."""
    scale = int8_scales(weight)
    q = torch.round(weight.detach().float() / scale.float()[:, None]).clamp(-QMAX, QMAX)  # [out, in]
    return q.to(torch.int8), scale


class Int8Linear(QuantizedLinear):
    scheme = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, act_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.bfloat16))
        self._init_bias(bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> Int8Linear:
        return cls(in_features, out_features, bias, act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        check_float_linear(cls.scheme, linear)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        q, s = quantize_int8(linear.weight)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        m._copy_bias(linear)
        return m

    def use_pack(self, rows: int) -> bool:
        return (known(rows <= PACK_MAX_ROWS) and self.in_features % PACK_K_MULTIPLE == 0
                and self.weight.device.type == "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if x2.dtype == torch.bfloat16 and self.use_pack(x2.shape[0]):  # fp32 activations stay fp32
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self.weight_scale)  # [M, out] bf16
        else:
            y = F.linear(x2, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)  # [M, out]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)  # [..., out]

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.float()[:, None]  # [out, in]
