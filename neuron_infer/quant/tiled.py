"""Weight tiling as a transform (`--weight-tiling`): linears whose weight is stored in the tiled layout.

Applied per rank after sharding and after quantization (neuron_infer.compile.quantize_step). A linear
y = x @ W (+ b) with HF weight [out, in] stores W = weight^T [K=in, N=out] as

    weight   [128, ceil(N/128), ceil(K/128), 128]   tiled[kp, nt, kt, np] = W[kt*128 + kp, nt*128 + np]
                                                     (neuron_infer.tiling.tile_weight; zero padded)

in its storage dtype, so the NKI MLP kernel (nki_kernels/mlp) reads it without a repack:

    kind    storage                       weight_scale [out]      source module            kernel entry point
    float   act dtype (fp32 / bf16)       -                       torch.nn.Linear          mlp_kernel
    fp8     float8_e4m3fn, |v| <= 240     float32                 quant.fp8.FP8Linear      mlp_fp8_kernel
    int8    int8, |q| <= 127              bf16                    quant.int8.Int8Linear    none (CPU reference only)

`TiledLinear.forward` (CPU) untiles the weight and runs the same math as the source module (F.linear, scale
applied after the matmul), so an artifact with and without tiling computes the same values up to summation order;
`reference_forward` is the slow twin that consumes the tiled layout directly (`tiling.tiled_matmul`, the
computation the kernel performs). `kernel_operands()` returns exactly the NumPy arrays the kernel takes.
`to_untiled()` rebuilds the source module bit for bit (the transform is invertible).

Not tiled: a float lm_head that shares its weight with the embedding (tiling would store a second copy of the
embedding); W8A8 (activation quantization state) and MX (the quad x4 layout of nc_matmul_mx) reject tiling
with a ConfigError in `quant.check_combination`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from neuron_infer.errors import ConfigError
from neuron_infer.quant.base import QuantizedLinear
from neuron_infer.quant.fp8 import FP8_DTYPE, FP8Linear, fp8_to_float
from neuron_infer.quant.int8 import Int8Linear
from neuron_infer.tiling import TILE, tile_weight, tiled_matmul, tiled_shape, untile_weight

LAYOUT = "[128, N/128, K/128, 128] (tiled[kp, nt, kt, np] = W[kt*128 + kp, nt*128 + np], W = weight^T [K=in, N=out])"
_STORAGE = {"fp8": FP8_DTYPE, "int8": torch.int8}
_SCALE = {"fp8": torch.float32, "int8": torch.bfloat16}


def pack_channel_scales(scale: np.ndarray) -> np.ndarray:
    """Per-output-channel scales [N] -> [128, ceil(N/128)] fp32; channel nt*128 + p at [p, nt] (padding 1.0)."""
    s = np.asarray(scale, dtype=np.float32)
    n_pad = -(-s.shape[0] // TILE) * TILE
    padded = np.ones(n_pad, dtype=np.float32)
    padded[: s.shape[0]] = s
    return np.ascontiguousarray(padded.reshape(n_pad // TILE, TILE).T)  # [N/128, 128] -> [128, N/128]


class TiledLinear(nn.Module):
    """A linear whose weight lives in the tiled layout (see the module docstring for kinds and buffers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, act_dtype: torch.dtype) -> None:
        super().__init__()
        if kind not in ("float", "fp8", "int8"):
            raise ConfigError(f"TiledLinear kind {kind!r} is unknown; choose float, fp8 or int8")
        self.in_features, self.out_features, self.kind, self.act_dtype = int(in_features), int(out_features), kind, act_dtype
        shape = tiled_shape(self.in_features, self.out_features)  # [128, N/128, K/128, 128]
        self.register_buffer("weight", torch.zeros(shape, dtype=_STORAGE.get(kind, act_dtype)))
        scale = torch.ones(out_features, dtype=_SCALE[kind]) if kind in _SCALE else None
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", torch.zeros(out_features, dtype=act_dtype) if bias else None)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, like: nn.Module) -> TiledLinear:
        """Uninitialised tiled twin of `like` (nn.Linear / FP8Linear / Int8Linear, possibly on the meta device)."""
        kind, act = _kind_of(like)
        return cls(like.in_features, like.out_features, like.bias is not None, kind, act)

    @classmethod
    def from_module(cls, mod: nn.Module) -> TiledLinear:
        """Tile a float / FP8 / INT8 linear (weight [out, in] -> tiled W^T); scales and bias are copied as is."""
        t = cls.empty(mod)
        with torch.no_grad():
            codes = mod.weight.detach()
            if t.kind == "fp8":  # tile the raw bytes: permutes/pads of float8 tensors go through uint8
                t.weight.view(torch.uint8).copy_(tile_weight(codes.view(torch.uint8).T))
            else:
                t.weight.copy_(tile_weight(codes.T))  # [out, in] -> W [K, N] -> tiled
            if t.weight_scale is not None:
                t.weight_scale.copy_(mod.weight_scale.detach())
            if t.bias is not None:
                t.bias.copy_(mod.bias.detach())
        return t

    def to_untiled(self) -> nn.Module:
        """The source module rebuilt exactly (inverse of `from_module`)."""
        w = self.weight_kn().T.contiguous()  # [K, N] -> [out, in]
        if self.kind == "float":
            m = nn.Linear(self.in_features, self.out_features, self.bias is not None, dtype=self.act_dtype)
            with torch.no_grad():
                m.weight.copy_(w)
        else:
            m = (FP8Linear if self.kind == "fp8" else Int8Linear)(self.in_features, self.out_features,
                                                                   self.bias is not None, self.act_dtype)
            m.weight.view(torch.uint8).copy_(w.view(torch.uint8))
            m.weight_scale.copy_(self.weight_scale)
        if self.bias is not None:
            with torch.no_grad():
                m.bias.copy_(self.bias)
        return m

    # ---- math ---------------------------------------------------------------------------------------------------
    def weight_kn(self) -> torch.Tensor:
        """Stored codes/values untiled: W [K=in, N=out] in the storage dtype."""
        if self.kind == "fp8":  # float8 permutes go through the uint8 view (bit-exact)
            return untile_weight(self.weight.view(torch.uint8), self.in_features, self.out_features).view(FP8_DTYPE)
        return untile_weight(self.weight, self.in_features, self.out_features)

    def _dense(self, w_kn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored values (no scale) -> `dtype` (exact: fp8/int8 codes and bf16 are representable)."""
        return fp8_to_float(w_kn, dtype) if self.kind == "fp8" else w_kn.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: untile, then the source module's math (scale after the matmul)."""
        w = self._dense(self.weight_kn(), x.dtype).T  # [K, N] -> [out, in] (a view)
        y = F.linear(x, w)  # [..., out]
        if self.weight_scale is not None:
            y = y * self.weight_scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Slow twin: fp32 matmul that consumes the tiled layout (tiling.tiled_matmul), as the kernel does."""
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kind == "fp8":
            tiled = fp8_to_float(self.weight)  # [128, N/128, K/128, 128] fp32, exact
        else:
            tiled = self.weight.float()
        y = tiled_matmul(x2, tiled, self.out_features)  # [M, N]
        if self.weight_scale is not None:
            y = y * self.weight_scale.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., out]

    def dequantized_weight(self) -> torch.Tensor:
        """The represented weight, float32 [out, in]."""
        w = self._dense(self.weight_kn(), torch.float32).T  # [out, in]
        return w * self.weight_scale.float()[:, None] if self.weight_scale is not None else w.contiguous()

    def kernel_operands(self) -> tuple[np.ndarray, ...]:
        """What the NKI MLP kernel takes for this projection (no repack, no copy of the layout):
        float: (tiled weight [128, N/128, K/128, 128] as float32 or ml_dtypes.bfloat16,)
        fp8:   (tiled weight as ml_dtypes.float8_e4m3 (Neuron E4M3; bit-identical for |v| <= 240),
                scales [128, ceil(N/128)] fp32, channel nt*128 + p at [p, nt])."""
        if self.kind == "int8":
            raise ConfigError("the NKI MLP kernel has no int8-weight entry point; use --quant fp8 or none with "
                              "kernels='nki' (int8 tiled weights run the CPU reference forward)")
        if self.kind == "fp8":
            codes = self.weight.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3)
            return codes, pack_channel_scales(self.weight_scale.numpy())
        if self.weight.dtype == torch.bfloat16:
            return (self.weight.view(torch.int16).numpy().view(ml_dtypes.bfloat16),)
        return (self.weight.float().numpy(),)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tiled={tuple(self.weight.shape)}")


def _kind_of(mod: nn.Module) -> tuple[str, torch.dtype]:
    if type(mod) is nn.Linear:
        return "float", mod.weight.dtype
    if isinstance(mod, FP8Linear):
        return "fp8", mod.act_dtype
    if isinstance(mod, Int8Linear):
        return "int8", mod.act_dtype
    raise ConfigError(f"--weight-tiling cannot tile a {type(mod).__name__}: tiling supports float, fp8 and int8 "
                      "linears (not w8a8 or MX); drop --weight-tiling or pick one of --quant none/int8/fp8")


def _tileable(model: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """(name -> linear to tile, names kept) over the model's linears; rejects modules tiling cannot express."""
    head_shared = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    tile, kept = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, TiledLinear):
            raise ConfigError(f"{name} is already tiled; --weight-tiling is applied once")
        if not isinstance(mod, (nn.Linear, QuantizedLinear)):
            continue
        if name == "lm_head" and type(mod) is nn.Linear and embed is not None and head_shared is embed:
            kept.append(name)  # tied float head: tiling would store a second copy of the embedding
            continue
        _kind_of(mod)  # raises for w8a8 / MX with a clear message
        tile[name] = mod
    return tile, kept


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def tile_model(model: nn.Module) -> dict:
    """Replace every linear (float / FP8 / INT8) by its TiledLinear in place; return the manifest record."""
    tile, kept = _tileable(model)
    new = {n: TiledLinear.from_module(m) for n, m in tile.items()}  # build all first: a failure changes nothing
    before = sum(t.numel() * t.element_size() for m in tile.values() for t in (m.weight,))
    for n, m in new.items():
        _swap(model, n, m)
    after = sum(m.weight.numel() * m.weight.element_size() for m in new.values())
    return {"layout": LAYOUT, "tiled": sorted(new), "kept": kept,
            "weight_bytes_untiled": before, "weight_bytes_tiled": after}  # difference = zero padding to 128


def tile_structure(model: nn.Module) -> None:
    """Give a skeleton (already given its quantized structure) empty TiledLinears, to load an artifact's weights."""
    tile, _ = _tileable(model)
    for n, m in tile.items():
        _swap(model, n, TiledLinear.empty(m))


def untile_model(model: nn.Module) -> None:
    """Inverse of `tile_model`: every TiledLinear back to its source module (exact)."""
    for n, m in [(n, m) for n, m in model.named_modules() if isinstance(m, TiledLinear)]:
        _swap(model, n, m.to_untiled())
