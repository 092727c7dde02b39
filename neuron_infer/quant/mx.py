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
F.linear in the activation dtype (MX values are exact in bf16).

Block grouping: MXFP8Linear / MXFP4Linear use OCP blocks (32 contiguous inputs). `nc_matmul_mx` groups 8
partitions x 4 slots instead (mx_golden "quad order"), and which values share a scale changes the numbers, so
MXFP8QuadLinear / MXFP4QuadLinear (partitions = 128) quantize in quad order (in padded to a multiple of 512) and
`kernel_operands()` hands the kernel its packed x4 words and scales unchanged: CPU forward and kernel then
compute with identical values.
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
    """Base of the MX linears; subclasses fix `fmt`, `rule` and `partitions` (None = OCP contiguous blocks)."""

    fmt: ClassVar[str] = ""
    rule: ClassVar[str] = "ocp"
    partitions: ClassVar[int | None] = None

    def __init__(self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, act_dtype)
        multiple = mg.BLOCK if self.partitions is None else 4 * self.partitions
        self.in_padded = -(-in_features // multiple) * multiple
        per_byte = 2 if mg.get_format(self.fmt).bits == 4 else 1
        self.register_buffer("weight", torch.zeros(out_features, self.in_padded // per_byte, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, self.in_padded // mg.BLOCK, dtype=torch.uint8))
        self._init_bias(bias)
        if self.partitions is not None:  # quad position -> logical column (derived, so not in the state dict)
            inv = np.argsort(mg.quad_permutation(self.in_padded, self.partitions))
            self.register_buffer("col_from_quad", torch.from_numpy(inv), persistent=False)
        if per_byte == 2:  # e2m1 code -> value; a buffer (not a tensor made in forward) so compiled graphs share it
            self.register_buffer("fp4_values", torch.tensor(_FP4_VALUES, dtype=torch.float32), persistent=False)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> MXLinear:
        return cls(in_features, out_features, bias, act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXLinear:
        check_float_linear(cls.scheme, linear)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        w = linear.weight.detach().float().cpu().numpy()  # [out, in]
        w = mg.pad_axis(w, m.in_padded, axis=1)  # [out, in_pad]
        if cls.partitions is not None:
            w = mg.to_quad_order(w, axis=1, partitions=cls.partitions)  # columns in quad order
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
            return self.fp4_values[unpack_fp4_bytes(self.weight)]  # [out, in_pad]
        return fp8_to_float(self.weight.view(torch.float8_e4m3fn))  # [out, in_pad]

    def dequantized_weight(self) -> torch.Tensor:
        vals = self._element_values().reshape(self.out_features, -1, mg.BLOCK)  # [out, in_pad/32, 32]
        w = vals * e8m0_to_float(self.weight_scale)[..., None]  # exact power-of-two scaling
        w = w.reshape(self.out_features, self.in_padded)  # [out, in_pad] (quad order for quad variants)
        if self.partitions is not None:
            w = w[:, self.col_from_quad]  # back to logical column order
        return w[:, : self.in_features]  # [out, in]

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


    def kernel_operands(self) -> tuple[np.ndarray, np.ndarray]:
        """Quad variants only: (x4 words [in_pad/4, out], scales [in_pad/32, out]) = W^T as nc_matmul_mx operands."""
        if self.partitions is None:
            raise ValueError(f"{type(self).__name__} uses OCP contiguous blocks; use the Quad variant for kernels")
        el, sc = self.golden_arrays()  # [out, in_pad] quad order, [out, in_pad/32]
        return mg.pack_x4(el.T, axis=0), np.ascontiguousarray(sc.T)


class MXFP8Linear(MXLinear):
    scheme = "mxfp8"
    fmt = "e4m3fn"
    rule = "nki"


class MXFP4Linear(MXLinear):
    scheme = "mxfp4"
    fmt = "e2m1"
    rule = "ocp"


class MXFP8QuadLinear(MXFP8Linear):
    partitions = 128


class MXFP4QuadLinear(MXFP4Linear):
    partitions = 128
