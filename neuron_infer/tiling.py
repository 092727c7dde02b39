"""Weight tiling for Neuron decode matmuls (transformers-neuronx `weight_tiling`).

Applied per rank after TP sharding (and after quantization: the layout is dtype-agnostic, scales stay per output
column). A weight ``W[K, N]`` (K = contraction/input dim, N = output dim; i.e. the *transpose* of an HF
``nn.Linear.weight [out, in]``) is zero-padded to multiples of 128, viewed as ``[K/128, 128, N/128, 128]`` and
permuted with order ``[1, 2, 0, 3]``:

    tiled[kp, nt, kt, np] = W[kt*128 + kp, nt*128 + np]          shape [128, N/128, K/128, 128], contiguous

    W [K, N]                         tiled: partition-major 128-row slices
    +--------+--------+----          kp = 0 : [ (nt=0: kt=0 [128] kt=1 [128] ...) (nt=1: kt=0 ...) ... ]
    | kt=0   | kt=0   |              kp = 1 : [ ...                                                    ]
    | nt=0   | nt=1   |   ...        ...
    +--------+--------+----          kp = 127
    | kt=1   | kt=1   |
    | nt=0   | nt=1   |              each (kp) row holds, for every output tile nt and contraction tile kt, the
    +--------+--------+----          128 contiguous outputs np of input row kt*128 + kp

So SBUF partition kp receives one long contiguous run per DMA, and the matmul contracts activations viewed as
``[M, K/128, 128]`` over (kt, kp) against weight dims (2, 0): `tiled_matmul` below is that computation in torch
(the reference the NKI MLP kernel is tested against). Transformers-neuronx asserts K, N % 128 == 0; we pad with
zeros (zero rows/columns add nothing to the dot products) and `untile_weight(tiled, K, N)` drops the padding.
"""
from __future__ import annotations

import numpy as np
import torch

TILE = 128


def _ceil(n: int) -> int:
    return -(-n // TILE) * TILE


def _permute(x, order):
    return x.permute(*order) if isinstance(x, torch.Tensor) else np.transpose(x, order)


def _pad2(w, kp: int, np_: int):
    k, n = w.shape
    if (k, n) == (kp, np_):
        return w
    if isinstance(w, torch.Tensor):
        out = torch.zeros(kp, np_, dtype=w.dtype, device=w.device)
    else:
        out = np.zeros((kp, np_), dtype=w.dtype)
    out[:k, :n] = w
    return out


def tiled_shape(k: int, n: int) -> tuple[int, int, int, int]:
    return (TILE, _ceil(n) // TILE, _ceil(k) // TILE, TILE)


def tile_weight(w):
    """[K, N] (torch or NumPy, any dtype) -> contiguous [128, ceil(N/128), ceil(K/128), 128], zero padded."""
    if w.ndim != 2:
        raise ValueError(f"tile_weight needs a 2-D [K, N] weight, got shape {tuple(w.shape)}")
    k, n = w.shape
    kp, np_ = _ceil(k), _ceil(n)
    w4 = _pad2(w, kp, np_).reshape(kp // TILE, TILE, np_ // TILE, TILE)  # [kt, kp, nt, np]
    t = _permute(w4, (1, 2, 0, 3))  # [kp, nt, kt, np]
    return t.contiguous() if isinstance(t, torch.Tensor) else np.ascontiguousarray(t)


def untile_weight(tiled, k: int, n: int):
    """Inverse of `tile_weight`: [128, N/128, K/128, 128] -> [K, N] (padding removed)."""
    if tuple(tiled.shape) != tiled_shape(k, n):
        raise ValueError(f"tiled weight has shape {tuple(tiled.shape)}; K={k}, N={n} needs {tiled_shape(k, n)}")
    w4 = _permute(tiled, (2, 0, 1, 3))  # [kt, kp, nt, np]
    w = w4.reshape(_ceil(k), _ceil(n))  # [K_pad, N_pad]
    w = w[:k, :n]
    return w.contiguous() if isinstance(w, torch.Tensor) else np.ascontiguousarray(w)


def tile_linear_weight(weight_out_in):
    """HF nn.Linear weight [out, in] -> tiled W = weight^T [K=in, N=out]."""
    return tile_weight(weight_out_in.T)


def tiled_matmul(x: torch.Tensor, tiled: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] @ W[K, N] computed from the tiled layout, the way the decode graph consumes it -> [M, N]."""
    m, k = x.shape
    kt = tiled.shape[2]
    xp = torch.nn.functional.pad(x, (0, kt * TILE - k)).reshape(m, kt, TILE)  # [M, K/128 (kt), 128 (kp)]
    y = torch.einsum("mtp,pntq->mnq", xp, tiled.to(x.dtype))  # contract (kt, kp): [M, N/128, 128]
    return y.reshape(m, -1)[:, :n]  # [M, N]
