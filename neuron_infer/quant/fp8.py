"""FP8 (E4M3) weights with Neuron semantics, OCP-checkpoint rescaling, and the FP8 KV-cache direct cast.

Neuron's FP8 E4M3 ("FP8_EXP4", IEEE-like, ml_dtypes.float8_e4m3) has max 240; OCP `float8_e4m3fn` has max 448.
Both use bias 7 and 3 mantissa bits; they differ only in exponent field 15 (e4m3: inf/NaN; e4m3fn: 256..448 and
one NaN). So `float8_e4m3fn` bytes whose values lie in [-240, 240] are bit-identical to Neuron E4M3, and we store
weights as torch.float8_e4m3fn restricted to that range (tests check all 256 codes).

Stored per linear:
  weight        float8_e4m3fn [out, in]   |value| <= 240, = RNE(w / scale)
  weight_scale  float32       [out]       absmax / 240 per output channel (TNX 'vector_dynamic' FP8 bound)
  bias          act           [out]       optional
Bound: with v = w / scale (|v| <= 240, never clipped), |dequant - w| <= scale * max(|v| * 2**-4, 2**-10):
half an ulp of a 3-bit mantissa (relative 2**-4) for normals |v| >= 2**-6, half the subnormal step 2**-9 below.

Forward dequantizes after the matmul as on Neuron: y = (x @ fp8_to(w, x.dtype)^T) * scale + bias. The fp8 -> float
conversion is a bit-exact integer trick. A CPU has no FP8 GEMM that streams fp8 weights the way the GEMV kernels
stream bf16 and int8 ones (torch._scaled_mm is a GEMM), so FP8 on CPU is a numerics emulation of the Neuron path,
far slower than bf16; use int8 for CPU speed.

Saturation (direct casts, e.g. the KV cache): finite values are clamped to [-240, 240] before the RNE cast, so
+-inf saturate to +-240 and in-range inputs never produce inf/NaN; NaN inputs stay NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.errors import CheckpointError
from neuron_infer.quant.base import QuantizedLinear, check_float_linear, per_channel_absmax

NEURON_FP8_MAX = 240.0
OCP_FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
_POW2_120 = 2.0 ** 120  # e4m3 exponent bias 7 vs float32 bias 127
_INT32_MIN = -(2 ** 31)


def fp8_to_float(w8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact float8_e4m3fn -> `dtype` for finite codes (|v| <= 448), via float32 bit placement.

    On CPU: the 7 magnitude bits eeee.mmm go to float32 bits 26..20, giving 2**(e-127) * 1.mmm (or the float32
    subnormal 0.mmm * 2**-126 when e == 0); times 2**120 that is exactly the e4m3 value. The NaN code maps to
    480 (never stored: our weights are finite by construction).
    Other devices (XLA/Neuron) use the native cast, which their compilers lower directly.
    """
    if w8.device.type != "cpu":
        return w8.to(dtype)
    codes = w8.view(torch.uint8).to(torch.int32)  # [...]
    sign = (codes >> 7) * _INT32_MIN  # 0 or 0x80000000 (no overflow: 1 * INT32_MIN)
    bits = ((codes & 0x7F) << 20) | sign  # float32 bit pattern of value * 2**-120
    return (bits.view(torch.float32) * _POW2_120).to(dtype)  # exact power-of-two rescale


def fp8_saturating_cast(x: torch.Tensor, limit: float = NEURON_FP8_MAX) -> torch.Tensor:
    """Direct cast to float8_e4m3fn inside the Neuron range: clamp to +-limit (inf saturates), then RNE."""
    return x.float().clamp(-limit, limit).to(FP8_DTYPE)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in] within +-240, float32 scale [out] = absmax / 240)."""
    scale = (per_channel_absmax(weight) / NEURON_FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [out]
    v = weight.detach().float() / scale[:, None]  # [out, in], |v| <= 240 up to division rounding
    return fp8_saturating_cast(v), scale


class FP8Linear(QuantizedLinear):
    scheme = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, act_dtype)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self._init_bias(bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> FP8Linear:
        return cls(in_features, out_features, bias, act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        check_float_linear(cls.scheme, linear)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        q, s = quantize_fp8(linear.weight)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        m._copy_bias(linear)
        return m

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 act_dtype: torch.dtype) -> FP8Linear:
        """Wrap an already-quantized Neuron-range FP8 weight (e.g. from `rescale_ocp_fp8`)."""
        check_neuron_range(weight, "weight")
        out_f, in_f = weight.shape
        m = cls(in_f, out_f, bias is not None, act_dtype)
        m.weight.copy_(weight)
        m.weight_scale.copy_(_per_channel(weight_scale, out_f).float())
        if bias is not None:
            m.bias.copy_(bias.to(act_dtype))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fp8_to_float(self.weight, x.dtype)  # [out, in], exact
        y = F.linear(x, w) * self.weight_scale.to(x.dtype)  # [..., out]: scale after the matmul, as on Neuron
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def dequantized_weight(self) -> torch.Tensor:
        return fp8_to_float(self.weight) * self.weight_scale[:, None]  # [out, in]


# ---------------------------------------------------------------------------------------------------------------
# OCP FP8 checkpoints (+-448) -> Neuron range (+-240)


def _per_channel(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """Scalar / [out] / [out, 1] scale -> [out]."""
    s = scale.detach().float().reshape(-1)
    if s.numel() == 1:
        return s.expand(out_features).clone()
    if s.numel() != out_features:
        raise CheckpointError(
            f"FP8 weight_scale has {s.numel()} values; expected 1 (per tensor) or {out_features} (per channel)"
        )
    return s


def check_neuron_range(weight: torch.Tensor, name: str) -> None:
    """Raise if an FP8 tensor holds values outside Neuron's +-240 (they would become NaN on the device)."""
    if weight.dtype != FP8_DTYPE:
        raise CheckpointError(f"{name}: expected a float8_e4m3fn tensor, got {weight.dtype}")
    amax = fp8_to_float(weight).abs().max().item() if weight.numel() else 0.0
    if amax > NEURON_FP8_MAX:
        raise CheckpointError(
            f"{name}: FP8 values reach {amax:g}, outside Neuron's E4M3 range +-{NEURON_FP8_MAX:g} (an OCP e4m3fn "
            "checkpoint, max 448?). Rescale it first: `neuron-infer quantize --rescale` / rescale_ocp_fp8()"
        )


def rescale_ocp_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, method: str = "pow2",
                    verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP e4m3fn weight (+-448) and its scale -> (Neuron-range weight, compensated scale [out]).

    method "pow2": divide values by 2 and double the scale — exact except that values below 2**-5 lose their last
    subnormal bit. method "nxdi": divide by 448/240 and multiply the scale by it (the published NxDI recipe; uses the
    whole +-240 range but re-rounds every value). With `verify`, the dequantized weights before/after are compared
    against the re-rounding bound scale_new * max(|v_new| * 2**-4, 2**-10) and a CheckpointError is raised on any
    violation (or on NaN codes in the input).
    """
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise CheckpointError(f"rescale_ocp_fp8 needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    factor = {"pow2": 2.0, "nxdi": OCP_FP8_MAX / NEURON_FP8_MAX}.get(method)
    if factor is None:
        raise CheckpointError(f"rescale method {method!r} is unknown; choose 'pow2' (exact) or 'nxdi'")
    before = weight.float()  # torch's own conversion: NaN codes stay NaN (caught by verification)
    scale = _per_channel(weight_scale, weight.shape[0])  # [out]
    new_w = fp8_saturating_cast(before / factor)  # [out, in] within +-240
    new_scale = scale * factor
    if verify:
        verify_rescale(weight, scale, new_w, new_scale)
    return new_w, new_scale


def verify_rescale(old_w: torch.Tensor, old_scale: torch.Tensor, new_w: torch.Tensor,
                   new_scale: torch.Tensor) -> None:
    """Check the rescaled FP8 weight dequantizes to the original within one RNE rounding (see rescale_ocp_fp8)."""
    old = old_w.float() * old_scale[:, None]  # [out, in]
    v_new = fp8_to_float(new_w)  # [out, in]
    new = v_new * new_scale[:, None]
    bound = new_scale[:, None] * torch.clamp(v_new.abs() * 2.0 ** -4, min=2.0 ** -10) * (1 + 1e-6)
    bad = ~((new - old).abs() <= bound)  # NaN compares False -> flagged
    if bad.any() or v_new.abs().max() > NEURON_FP8_MAX:
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
        raise CheckpointError(
            f"FP8 rescale verification failed at {int(bad.sum())} element(s) (first {idx}): the input holds NaN or "
            "out-of-range codes; re-export the checkpoint from its bf16 source"
        )


# ---------------------------------------------------------------------------------------------------------------
# FP8 KV cache (direct cast, as NxDI's default kv_cache_quant)


def kv_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """K/V activations -> float8_e4m3fn by direct cast (no scale), saturating at +-240 (Neuron range)."""
    return fp8_saturating_cast(x)


def kv_from_fp8(x8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `kv_to_fp8` (exact): stored fp8 -> compute dtype."""
    return fp8_to_float(x8, dtype)


# ---------------------------------------------------------------------------------------------------------------
# whole checkpoints (for `neuron-infer quantize --rescale`)


def fp8_weight_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the float8_e4m3fn tensors of a state dict; each must have a `<name>_scale` sibling."""
    names = [k for k, v in state.items() if v.dtype == FP8_DTYPE]
    missing = [k for k in names if f"{k}_scale" not in state]
    if missing:
        raise CheckpointError(
            f"FP8 tensor(s) {missing[:3]}{' ...' if len(missing) > 3 else ''} have no '<name>_scale' tensor; "
            "neuron-infer reads per-tensor or per-channel scaled FP8 checkpoints (weight + weight_scale)"
        )
    return names


def rescale_fp8_state_dict(state: dict[str, torch.Tensor], rescale: bool, method: str = "pow2"
                           ) -> dict[str, torch.Tensor]:
    """Bring every FP8 weight of a checkpoint into the Neuron range.

    rescale=False: only check (CheckpointError naming the first out-of-range tensor and suggesting --rescale).
    rescale=True: `rescale_ocp_fp8` (with verification) on every FP8 weight; scales become float32 [out].
    Returns a new dict; the input is not modified.
    """
    out = dict(state)
    for name in fp8_weight_names(state):
        if not rescale:
            check_neuron_range(state[name], name)
            continue
        if state[name].dim() != 2:
            raise CheckpointError(f"{name}: FP8 rescaling handles 2-D linear weights, got shape {tuple(state[name].shape)}")
        out[name], out[f"{name}_scale"] = rescale_ocp_fp8(state[name], state[f"{name}_scale"], method)
    return out
