"""SmoothQuant W8A8: activation-outlier smoothing folded into the model, int8 weights, per-token int8 activations.

Pipeline (Xiao et al., SmoothQuant; our own implementation):
1. `collect_act_absmax(model, run_calibration)` — forward pre-hooks on every nn.Linear record the per-input-channel
   max |x| while `run_calibration()` runs the float model over sample text.
2. `smooth_model(model, absmax, alpha)` — per decoder layer, s_j = max|X_j|**alpha / max|W_:j|**(1-alpha) and
   x / s is folded into the preceding RMSNorm weight, W * s into the consumers (`fold_smoothing`):
   input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj, and (optional, on by default) up_proj's
   output rows -> down_proj's input columns (exact because silu(gate) * up is linear in up).
   The float model's function is unchanged up to rounding (tested).
3. `apply_quantization(model, QuantConfig(scheme="w8a8"))` swaps every linear for `W8A8Linear`:
     weight        int8    [out, in]  per output channel, scale = absmax / 127 (bound: scale / 2 per element)
     weight_scale  float32 [out]
   forward: per-token dynamic int8 activations (row scale = max|x_row| / 127, RNE, clamp +-127), exact int32
   accumulation, then y = acc * x_scale * w_scale (+ bias): `w8a8_matmul` (`torch._int_mm`). In graphs the CPU
   backend compiles, its op table (backends/cpu/ops.py) gives linears on 1-8 bf16 rows to the C kernel
   backends/cpu/cpu_gemv_w8a8.cpp (VNNI where the CPU has it), which computes the same values bit for bit.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from neuron_infer.config import QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.quant import apply_quantization
from neuron_infer.quant.base import QuantizedLinear, check_float_linear, per_channel_absmax

QMAX = 127
_EPS = 1e-5  # floor for absmax values so all-zero channels get a finite smoothing factor


def quantize_int8_fp32_scale(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale [out] = absmax / 127)."""
    scale = (per_channel_absmax(weight) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(weight.detach().float() / scale[:, None]).clamp(-QMAX, QMAX)  # [out, in]
    return q.to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, in] float -> (int8 [M, in], float32 scale [M, 1] = max|x_row| / 127)."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)  # [M, 1]
    return torch.round(xf / s).clamp(-QMAX, QMAX).to(torch.int8), s


def w8a8_matmul(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, in] float, q int8 [out, in], w_scale fp32 [out] -> [M, out] in x.dtype: per-token int8 activations,
    exact int32 products, y = (acc * x_scale) * w_scale in fp32, rounded once."""
    xq, xs = quantize_per_token(x)  # [M, in] int8, [M, 1]
    acc = torch._int_mm(xq, q.t())  # [M, out] int32, exact
    return (acc.float() * xs * w_scale).to(x.dtype)


class W8A8Linear(QuantizedLinear):
    scheme = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, act_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self._init_bias(bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype) -> W8A8Linear:
        return cls(in_features, out_features, bias, act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W8A8Linear:
        check_float_linear(cls.scheme, linear)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        q, s = quantize_int8_fp32_scale(linear.weight)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        m._copy_bias(linear)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        y = w8a8_matmul(x2.contiguous(), self.weight, self.weight_scale)  # [M, out]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)  # [..., out]

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]  # [out, in]

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Slow twin: fake-quantize the activations per token, then a float32 F.linear with the dequantized weight."""
        xq, xs = quantize_per_token(x.reshape(-1, self.in_features))
        xd = (xq.float() * xs).reshape(*x.shape[:-1], self.in_features)  # [..., in]
        b = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(xd, self.dequantized_weight(), b).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# calibration and smoothing


def collect_act_absmax(model: nn.Module, run_calibration: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Run `run_calibration()` with hooks on every nn.Linear; return {linear name: max |x| per input channel}."""
    stats: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def fn(_mod, args):
            a = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)  # [in]
            stats[name] = torch.maximum(stats[name], a) if name in stats else a
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            run_calibration()
    finally:
        for h in handles:
            h.remove()
    if not stats:
        raise ConfigError("SmoothQuant calibration saw no activations: run_calibration() never called the model")
    return stats


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] = max|X_j|**alpha / max_i |W_ij|**(1-alpha) over all consumer weights [out_i, in]."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"SmoothQuant alpha={alpha} must be in [0, 1] (0.5 is the usual migration strength)")
    w_max = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)  # [in]
    a = act_absmax.float().clamp_min(_EPS)
    return (a.pow(alpha) / w_max.clamp_min(_EPS).pow(1.0 - alpha)).clamp_min(_EPS)


def fold_smoothing(norm_weight: torch.Tensor, weights: list[torch.Tensor], act_absmax: torch.Tensor,
                   alpha: float) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Pure fold: (norm_weight / s, [W * s per input column], s). The network function is unchanged:
    W (g * n) = (W diag(s)) ((g / s) * n)."""
    s = smoothing_factors(act_absmax, weights, alpha)  # [in]
    new_norm = (norm_weight.float() / s).to(norm_weight.dtype)
    new_ws = [(w.float() * s[None, :]).to(w.dtype) for w in weights]  # [out, in] * [1, in]
    return new_norm, new_ws, s


def fold_into_producer(producer_weight: torch.Tensor, producer_bias: torch.Tensor | None,
                       consumer_weight: torch.Tensor, act_absmax: torch.Tensor, alpha: float):
    """Like fold_smoothing, but x / s is folded into the rows of the linear producing x (up_proj -> down_proj)."""
    s = smoothing_factors(act_absmax, [consumer_weight], alpha)  # [in of consumer] = [out of producer]
    new_p = (producer_weight.float() / s[:, None]).to(producer_weight.dtype)  # [out_p, in_p]
    new_b = None if producer_bias is None else (producer_bias.float() / s).to(producer_bias.dtype)
    return new_p, new_b, (consumer_weight.float() * s[None, :]).to(consumer_weight.dtype), s


_LAYER = re.compile(r"^(.*layers\.\d+)\.self_attn\.q_proj$")


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


def smooth_model(model: nn.Module, act_absmax: dict[str, torch.Tensor], alpha: float = 0.5,
                 smooth_down: bool = True) -> int:
    """Fold smoothing into every decoder layer of an HF-named Llama module tree; returns the layer count."""
    layers = [m.group(1) for n, _ in model.named_modules() if (m := _LAYER.match(n))]
    if not layers:
        raise ConfigError("smooth_model found no '<prefix>.layers.N.self_attn.q_proj' linear; is this a Llama model?")
    get = model.get_submodule
    for p in layers:
        groups = ((f"{p}.input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                  (f"{p}.post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
        for norm_name, cons in groups:
            lins = [get(f"{p}.{c}") for c in cons]
            key = f"{p}.{cons[0]}"
            if key not in act_absmax:
                raise ConfigError(f"no calibration statistics for {key}; run collect_act_absmax on this model")
            norm = get(norm_name)
            new_norm, new_ws, _ = fold_smoothing(norm.weight, [lin.weight for lin in lins], act_absmax[key], alpha)
            _set(norm.weight, new_norm)
            for lin, w in zip(lins, new_ws):
                _set(lin.weight, w)
        if smooth_down:
            up, down = get(f"{p}.mlp.up_proj"), get(f"{p}.mlp.down_proj")
            new_up, new_b, new_down, _ = fold_into_producer(up.weight, up.bias, down.weight,
                                                            act_absmax[f"{p}.mlp.down_proj"], alpha)
            _set(up.weight, new_up)
            _set(down.weight, new_down)
            if new_b is not None:
                _set(up.bias, new_b)
    return len(layers)


def smoothquant(model: nn.Module, run_calibration: Callable[[], object], alpha: float = 0.5,
                modules_to_not_convert: tuple[str, ...] = (), smooth_down: bool = True):
    """Calibrate, smooth and convert to W8A8 in place; returns the QuantReport."""
    absmax = collect_act_absmax(model, run_calibration)
    smooth_model(model, absmax, alpha, smooth_down)
    return apply_quantization(model, QuantConfig(scheme="w8a8", modules_to_not_convert=modules_to_not_convert))
