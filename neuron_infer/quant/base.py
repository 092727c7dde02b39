"""The quantization strategy interface: one `QuantizedLinear` subclass per scheme.

A scheme module replaces a float `nn.Linear` (HF layout: weight [out, in], optional bias [out]) after the float
model exists. Every scheme provides

* ``from_linear(linear)``       quantize a float linear (the weights are read once, on CPU);
* ``empty(in, out, bias, act_dtype)``  the same module with uninitialised storage of the right shapes/dtypes, so a
  compiled artifact's state dict loads with ``load_state_dict(strict=True)``;
* ``forward(x [..., in]) -> [..., out]`` in ``x.dtype``; export/compile friendly (no data-dependent Python control
  flow — branches depend only on static shapes and dtypes);
* ``dequantized_weight() -> [out, in] float32`` the weight the scheme actually represents;
* ``reference_forward(x)`` the slow twin: dequantize, then ``F.linear`` in float32 (the test oracle);
* ``weight_bytes()`` bytes of every tensor the module stores (payload, scales, bias).

All stored tensors are buffers (not parameters): quantized weights are never trained, and buffers appear in the
state dict like parameters do.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.errors import ConfigError

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

def check_act_dtype(scheme: str, act_dtype: torch.dtype) -> None:
    """Activation (compute) dtypes every scheme supports; anything else is a configuration error."""
    if act_dtype not in ACT_DTYPES:
        raise ConfigError(
            f"--quant {scheme} needs a floating-point model dtype (fp32, bf16 or fp16), got {act_dtype}; "
            "quantize the float checkpoint, not an already-quantized one"
        )


def check_float_linear(scheme: str, linear: nn.Linear) -> None:
    if not isinstance(linear, nn.Linear):
        raise ConfigError(f"--quant {scheme} converts torch.nn.Linear modules, got {type(linear).__name__}")
    check_act_dtype(scheme, linear.weight.dtype)
    if linear.weight.device.type == "meta":
        raise ConfigError(
            f"--quant {scheme}: the linear weight is on the meta device (not loaded); load the checkpoint first, "
            "or use structure_only=True to build empty quantized modules for an artifact's state dict"
        )


class QuantizedLinear(nn.Module, ABC):
    """Base class of every scheme's linear. Subclasses set `scheme` and implement the abstract methods."""

    scheme: ClassVar[str] = ""

    def __init__(self, in_features: int, out_features: int, act_dtype: torch.dtype) -> None:
        super().__init__()
        check_act_dtype(self.scheme, act_dtype)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.act_dtype = act_dtype
        self.bias: torch.Tensor | None

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> QuantizedLinear:
        """Module with uninitialised storage of the right shapes/dtypes (for load_state_dict(strict=True))."""

    @classmethod
    @abstractmethod
    def from_linear(cls, linear: nn.Linear) -> QuantizedLinear:
        """Quantize a float nn.Linear (weight [out, in])."""

    def _init_bias(self, bias: bool) -> None:
        b = torch.empty(self.out_features, dtype=self.act_dtype) if bias else None
        self.register_buffer("bias", b)

    def _copy_bias(self, linear: nn.Linear) -> None:
        if linear.bias is not None:
            self.bias.copy_(linear.bias.detach().to(self.act_dtype))

    # ---- math ---------------------------------------------------------------------------------------------------
    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fast path: x [..., in] -> [..., out] in x.dtype."""

    @abstractmethod
    def dequantized_weight(self) -> torch.Tensor:
        """The represented weight, float32 [out, in]."""

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Slow twin (test oracle): dequantize, then a float32 F.linear; returns x.dtype."""
        b = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantized_weight(), b).to(x.dtype)  # [..., out]

    def weight_bytes(self) -> int:
        """Bytes of the stored tensors (the state dict: derived non-persistent tables are not stored)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def extra_repr(self) -> str:
        return (f"scheme={self.scheme}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, act_dtype={self.act_dtype}")


def linear_weight_bytes(linear: nn.Linear) -> int:
    """Bytes a float nn.Linear stores (weight and bias)."""
    return sum(p.numel() * p.element_size() for p in linear.parameters(recurse=False))


def per_channel_absmax(weight: torch.Tensor) -> torch.Tensor:
    """max |w| over the input dim: [out, in] -> [out] float32 (the per-output-channel range)."""
    return weight.detach().float().abs().amax(dim=1)
