"""`kernels="nki"`: the Llama op table backed by the NKI kernels in nki_kernels/ (attention, MLP; MX linear helper).

Each op converts torch tensors to the kernel layout, calls the `nki.jit` kernel and converts back. On CPU
`import nki_kernels` registers the NumPy simulator as `nki`, so a call runs the kernel on the CPU simulator
(slow: for tiny models and CI); weights are packed on the host (NumPy) and cached per module. While a graph is
traced for the neuron target (`nki_neuron.neuron_target()`, entered by backends/neuron/graph.py and
backends/neuron/tp.py) the same ops route to `model/nki_neuron.py`, which launches the kernels through the
SDK's `nki.jit` with torch tensors of the graph only (not yet run on hardware). RMSNorm stays the PyTorch
reference (it is fused into the MLP kernel only when called through `rmsnorm_mlp_kernel` directly).

attention(q, k_cache, v_cache, table, q_to_kv, positions):
    the table's blocks gathered into one sequence per row (model.ops.gather_blocks), then the prefill kernel when
    every row's positions are 0..T-1 (keys sliced to the first T slots), otherwise the decode kernel with per-row
    position bounds (chunks of query tokens so one KV-head group fits 128 partitions).
    Non-uniform q_to_kv (tensor-parallel padding / replication) is passed to the kernels as a static tuple.
    On an XLA device the positions cannot be inspected: T == S selects prefill (the context-encoding contract:
    prompt from position 0), anything else decode.
mlp(x, gate, up, down):
    the fused kernel when the three projections are bias-free `nn.Linear` (fp32/bf16 weights), bias-free
    `FP8Linear` modules, or bias-free `TiledLinear` modules of kind float / fp8 (`--weight-tiling`: their
    buffers already are the kernel's operands, `TiledLinear.kernel_operands()`); MX modules (`MXFP8Linear` / `MXFP4Linear`) run each projection through the MX matmul
    kernel (`mx_linear`, trn3 only) with SiLU(gate) * up in PyTorch; any other module (INT8, biased linears,
    mixed schemes, ...) falls back to `ops.mlp_ref`. Packed weights are cached per module and refreshed when
    the weight tensor changes.
mx_linear(x, module):
    y = x @ W^T (+ bias) through `nki_kernels/mx_matmul`. The kernel needs the hardware MX block grouping
    (8 partitions x 4 quad slots), not the OCP contiguous blocks the module stores, so the module's dequantized
    weight is re-quantized once with `mx_golden.quantize_for_matmul` (a second MX rounding: the result is
    within MX error of the module's forward, not bit-identical; re-quantizing from the float checkpoint would
    avoid it). Activations are quantized to MXFP8 on chip.
"""
from __future__ import annotations

import weakref

import ml_dtypes
import numpy as np
import torch
from torch import nn

from neuron_infer.model import nki_neuron
from neuron_infer.model.ops import Ops, call_linear, gather_blocks, mlp_ref
from neuron_infer.quant.fp8 import FP8Linear
from neuron_infer.quant.mx import MXLinear
from neuron_infer.quant.tiled import TiledLinear
from neuron_infer.tiling import tile_weight
from nki_kernels.attention_decode.kernel import attention_decode
from nki_kernels.attention_prefill.kernel import flash_attention_prefill
from nki_kernels.mlp.kernel import mlp_fp8_kernel, mlp_kernel
from nki_kernels.mlp.reference import pack_scales
from nki_kernels.mx_matmul.kernel import mx_matmul_kernel
from nki_kernels.mx_matmul.reference import pack_mx_weight, pad_k

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PARTITIONS = 128


def _kernel_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in _KERNEL_DTYPES else torch.float32


def _is_prefill(positions: torch.Tensor, t: int, s: int) -> bool:
    if t > s:
        return False
    if positions.device.type != "cpu":
        return t == s
    return bool((positions == torch.arange(t, device=positions.device)).all())


def attention(q, k_cache, v_cache, table, q_to_kv, positions):
    """Causal GQA attention [B, Hq, T, D] over the blocks `table` [B, W] names in the caches [N, Hkv, bs, D] (see the
    module docstring for the kernel choice)."""
    k, v = gather_blocks(k_cache, table), gather_blocks(v_cache, table)  # [B, Hkv, W*bs, D] each
    launcher = nki_neuron.active()
    if launcher is not None:                                         # tracing for the neuron target
        return nki_neuron.attention(launcher, q, k, v, q_to_kv, positions)
    dt = _kernel_dtype(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    t, d = q.shape[2], q.shape[3]
    mapping = tuple(int(i) for i in q_to_kv.tolist())
    scale = 1.0 / float(d) ** 0.5
    if _is_prefill(positions, t, k.shape[2]):
        qT = q.transpose(2, 3).contiguous()                          # [B, Hq, D, T]
        kT = k[:, :, :t].transpose(2, 3).contiguous()                # [B, Hkv, D, T]
        out = flash_attention_prefill(qT, kT, v[:, :, :t].contiguous(), mapping, scale)
        return out.to(q.dtype)
    return _decode(q, k, v, mapping, positions, scale)


def _decode(q, k, v, mapping, positions, scale):
    group = max(mapping.count(h) for h in set(mapping))
    chunk = max(1, PARTITIONS // group)                              # query tokens per call: group*chunk <= 128
    kT = k.transpose(2, 3).contiguous()                              # [B, Hkv, D, S]
    vc = v.contiguous()
    outs = []
    for t0 in range(0, q.shape[2], chunk):
        qT = q[:, :, t0:t0 + chunk].transpose(2, 3).contiguous()     # [B, Hq, D, Tc]
        pos = positions[:, t0:t0 + chunk].to(torch.float32).contiguous()   # [B, Tc], exact below 2**24
        outs.append(attention_decode(qT, kT, vc, pos, mapping, scale))
    return torch.cat(outs, dim=2)                                    # [B, Hq, T, D]


# ---------------------------------------------------------------------------------------------------------------
# MLP

_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _weight_key(m: nn.Module) -> tuple:
    w = m.weight
    return (w.data_ptr(), w._version, tuple(w.shape), w.dtype)


def _pack_float(m: nn.Linear, dtype: torch.dtype) -> np.ndarray:
    w = m.weight.detach().to(dtype).T.contiguous()                   # [out, in] -> W [K=in, N=out]
    if dtype == torch.bfloat16:
        arr = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        arr = w.numpy()
    return tile_weight(arr)                                          # [128, N/128, K/128, 128]


def _pack_fp8(m: FP8Linear) -> tuple[np.ndarray, np.ndarray]:
    codes = m.weight.detach().view(torch.uint8).T.contiguous().numpy()   # [out, in] -> [K, N] E4M3 bytes
    tiled = tile_weight(codes).view(ml_dtypes.float8_e4m3)          # |v| <= 240: e4m3fn bytes == Neuron e4m3
    return tiled, pack_scales(m.weight_scale.detach().float().numpy())


def _pack_mx(m: MXLinear) -> tuple[np.ndarray, np.ndarray]:
    w = m.dequantized_weight().detach().float().T.contiguous().numpy()   # [out, in] -> W [K=in, N=out]
    return pack_mx_weight(w, m.fmt, rule=m.rule)                         # (words [Kp/4, N], scales [Kp/32, N])


def _packed(m: nn.Module, dtype: torch.dtype):
    key = (_weight_key(m), dtype)
    hit = _PACKED.get(m)
    if hit is None or hit[0] != key:
        if isinstance(m, MXLinear):
            value = _pack_mx(m)
        elif isinstance(m, FP8Linear):
            value = _pack_fp8(m)
        else:
            value = (_pack_float(m, dtype),)
        _PACKED[m] = hit = (key, value)
    return hit[1]


def mx_linear(x: torch.Tensor, m: MXLinear) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out] with the MX matmul kernel (see the module docstring)."""
    words, scales = _packed(m, torch.bfloat16)
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)                   # [N, in]
    xp = torch.from_numpy(pad_k(x2.view(torch.int16).numpy(), axis=1)).view(torch.bfloat16)   # [N, Kp] zero pad
    y = mx_matmul_kernel(xp.contiguous(), words, scales)                # [N, out] bf16
    if m.bias is not None:
        y = y + m.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _kernel_kind(mods) -> str | None:
    if all(isinstance(m, MXLinear) for m in mods):
        return "mx"                                   # per projection: biases are added after the kernel
    if any(getattr(m, "bias", None) is not None for m in mods):
        return None
    if all(type(m) is nn.Linear and m.weight.dtype in _KERNEL_DTYPES for m in mods):
        return "float"
    if all(isinstance(m, FP8Linear) for m in mods):
        return "fp8"
    if all(isinstance(m, TiledLinear) for m in mods):
        kinds = {m.kind for m in mods} | {m.weight.dtype for m in mods if m.kind == "float"}
        if kinds in ({"fp8"}, {"float", torch.float32}, {"float", torch.bfloat16}):
            return "tiled"
    return None


def mlp(x, gate, up, down, linear=call_linear):
    """down(silu(gate(x)) * up(x)) [B, T, H] through the fused kernel, or `mlp_ref` (with the table's `linear`) for
    unsupported modules."""
    mods = (gate, up, down)
    kind = _kernel_kind(mods)
    if kind is None:
        return mlp_ref(x, gate, up, down, linear)
    launcher = nki_neuron.active()
    if launcher is not None:                                         # tracing for the neuron target
        if kind == "mx":                                             # host-packed MX layout: not in a graph
            return mlp_ref(x, gate, up, down, linear)
        return nki_neuron.mlp(launcher, kind, x, gate, up, down)
    if kind == "mx":
        h = torch.nn.functional.silu(mx_linear(x, gate)) * mx_linear(x, up)   # [B, T, I]
        return mx_linear(h, down)                                           # [B, T, H]
    lead = x.shape[:-1]
    if kind == "tiled":
        ops = [m.kernel_operands() for m in mods]            # (tiled weight,) or (tiled codes, packed scales)
        fp8 = mods[0].kind == "fp8"
        dt = torch.bfloat16 if fp8 else mods[0].weight.dtype  # float: x in the weight dtype (fp32 pairs with fp32)
        kind = "fp8" if fp8 else "float"
    else:
        dt = _kernel_dtype(x) if kind == "float" else torch.bfloat16
        ops = [_packed(m, dt) for m in mods]
    x2 = x.reshape(-1, x.shape[-1]).to(dt).contiguous()             # [B*T, H]
    if kind == "float":
        out = mlp_kernel(x2, *(p[0] for p in ops))
    else:
        out = mlp_fp8_kernel(x2, *(p[0] for p in ops), *(p[1] for p in ops))
    return out.to(x.dtype).reshape(*lead, -1)                       # [B, T, H]


def build_ops() -> Ops:
    """The `kernels="nki"` op table (rms_norm stays the PyTorch reference)."""
    return Ops(name="nki", attention=attention, mlp=mlp)
