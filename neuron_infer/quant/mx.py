"""MXFP8 / MXFP4 linear weights (OCP microscaling), quantized by the NumPy golden module `mx_golden`.

Blocks of 32 run along the contraction dim (`in_features`), padded with zeros to a multiple of 32 (zeros never
change a block scale or a dot product). Stored per linear:
  weight        uint8 [out, in_pad]      MXFP8: e4m3fn bytes
                uint8 [out, in_pad / 2]  MXFP4: two e2m1 codes per byte, element 2j in the low nibble
  weight_scale  uint8 [out, in_pad / 32] E8M0 bytes, value 2**(b - 127)
  bias          act   [out]              optional
Memory per weight: MXFP8 8.25 bits, MXFP4 4.25 bits (+ padding).

Scale rule defaults (relative MSE on Gaussian / Laplace / Student-t(3) weights, measured with mx_golden):
MXFP8 uses "nki" (2x the OCP scale, never clips: 7.0e-4 vs 8.6e-4 .. 1.0e-3 for "ocp"; also what NKI's
`quantize_mx` does on device); MXFP4 uses "ocp" (1.3e-2 .. 2.0e-2 vs 2.1e-2 .. 3.9e-2 for "nki": with only values
{0.5 .. 6} the extra headroom costs more than the clipping of the block maximum).

The CPU forward dequantizes with torch ops that mirror `mx_golden.dequantize` bit for bit (tested), then runs
F.linear in the activation dtype (MX values are exact in bf16). Blocks are contiguous runs of 32 (OCP). A kernel
that needs the `nc_matmul_mx` quad grouping re-quantizes with `mx_golden.quantize_for_matmul` from the float
checkpoint (the grouping changes which values share a scale).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.quant import mx_golden as mg
from neuron_infer.quant.base import QuantizedLinear, check_float_linear
from neuron_infer.quant.fp8 import fp8_to_float

# e2m1 code -> value (code bit 3 = sign, bits 2..1 exponent, bit 0 mantissa)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2**(b - 127), exact (byte 0 -> the float32 subnormal 2**-127)."""
    b = scale_bytes.to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 0x00400000))
    return bits.view(torch.float32)


def unpack_fp4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] uint8 (low nibble first) -> [..., n] int64 codes."""
    lo = (packed & 0x0F).to(torch.int64)
    hi = (packed >> 4).to(torch.int64)
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)  # [..., n/2, 2] -> [..., n]


def pack_fp4_codes(codes: np.ndarray) -> np.ndarray:
    """[..., n] uint8 codes (< 16) -> [..., n/2] uint8, element 2j in the low nibble."""
    c = codes.reshape(*codes.shape[:-1], -1, 2)  # [..., n/2, 2]
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)


class MXLinear(QuantizedLinear):
    """Base of MXFP8Linear / MXFP4Linear; subclasses fix `fmt` and `rule`."""

    fmt: ClassVar[str] = ""
    rule: ClassVar[str] = "ocp"

    def __init__(self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, act_dtype)
        self.in_padded = -(-in_features // mg.BLOCK) * mg.BLOCK
        per_byte = 2 if mg.get_format(self.fmt).bits == 4 else 1
        self.register_buffer("weight", torch.zeros(out_features, self.in_padded // per_byte, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, self.in_padded // mg.BLOCK, dtype=torch.uint8))
        self._init_bias(bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> "MXLinear":
        return cls(in_features, out_features, bias, act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "MXLinear":
        check_float_linear(cls.scheme, linear)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        w = linear.weight.detach().float().cpu().numpy()  # [out, in]
        w = mg.pad_axis(w, mg.BLOCK, axis=1)  # [out, in_pad]
        elems, scales = mg.quantize(w, cls.fmt, cls.rule, axis=1)  # [out, in_pad], [out, in_pad/32]
        codes = mg.element_codes(elems)
        if mg.get_format(cls.fmt).bits == 4:
            codes = pack_fp4_codes(codes)  # [out, in_pad/2]
        m.weight.copy_(torch.from_numpy(np.ascontiguousarray(codes)))
        m.weight_scale.copy_(torch.from_numpy(np.ascontiguousarray(scales)))
        m._copy_bias(linear)
        return m

    def _element_values(self) -> torch.Tensor:
        """[out, in_pad] float32 element values (before block scaling)."""
        if mg.get_format(self.fmt).bits == 4:
            table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=self.weight.device)
            return table[unpack_fp4_bytes(self.weight)]  # [out, in_pad]
        return fp8_to_float(self.weight.view(torch.float8_e4m3fn))  # [out, in_pad]

    def dequantized_weight(self) -> torch.Tensor:
        vals = self._element_values().reshape(self.out_features, -1, mg.BLOCK)  # [out, in_pad/32, 32]
        w = vals * e8m0_to_float(self.weight_scale)[..., None]  # exact power-of-two scaling
        return w.reshape(self.out_features, self.in_padded)[:, : self.in_features]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dequantized_weight().to(x.dtype))  # [..., out]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def golden_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(elements [out, in_pad] in the ml_dtypes element dtype, scales [out, in_pad/32]) for mx_golden."""
        codes = self.weight.cpu().numpy()
        if mg.get_format(self.fmt).bits == 4:
            codes = unpack_fp4_bytes(self.weight.cpu()).to(torch.uint8).numpy()
        return mg.elements_from_codes(codes, self.fmt), self.weight_scale.cpu().numpy()


class MXFP8Linear(MXLinear):
    scheme = "mxfp8"
    fmt = "e4m3fn"
    rule = "nki"


class MXFP4Linear(MXLinear):
    scheme = "mxfp4"
    fmt = "e2m1"
    rule = "ocp"
