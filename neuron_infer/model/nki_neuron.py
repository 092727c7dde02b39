"""`kernels="nki"` on the neuron target: the kernels launched through the Neuron SDK's `nki.jit` inside the traced
graph. NOT YET RUN ON HARDWARE.

Written against the documented NKI 0.6/0.7 + torch-neuronx API (AWS NKI and torch-neuronx documentation) and
exercised in CI through a recording test double of `nki` that runs each launch on our simulator
(tests/compile/test_neuron_nki.py). What differs from the CPU-simulator path of `model/nki_ops.py`:

* every kernel argument is a torch tensor of the graph (on the XLA device while torch-neuronx traces), never a
  NumPy array: weights are re-laid out into the kernel's tiled layout with torch ops inside the graph
  (`tiling.tile_weight` works on torch tensors; `--weight-tiling` checkpoints skip that: their buffers already
  are the layout), positions are cast with torch, nothing is cached across calls (a cache would freeze one
  trace's tensors into the graph);
* the kernel is wrapped once with the SDK's `nki.jit(fn)` and launched as `jitted[lnc](*args)`: the new API's
  only grid is the logical-NeuronCore degree (1 or 2), which must equal neuronx-cc's `--lnc` (error EVRF066)
  and the runtime's `NEURON_LOGICAL_NC_CONFIG`. The neuron backends resolve that degree once per compile
  (`backends/neuron/platform.py`: the environment, then the build, then the platform default - 2 on trn2/trn3)
  and pass the same value to neuronx-cc and to `neuron_target(lnc=...)`. The kernels do not split work by
  `nl.program_id` yet, so at LNC2 both physical cores compute the whole (identical) result: correct, not faster;
* prefill vs decode is decided from static shapes (T == S: the context-encoding contract, prompt from position 0),
  never from position values, which the trace cannot read; the query-to-KV head map is a constant buffer read
  once at trace time and baked into the launch as a static tuple;
* MX projections keep the module's PyTorch forward on this target (their hardware block layout is packed on the
  host, which a traced graph cannot do); INT8/biased projections fall back to `ops.mlp_ref` as on CPU.

Selection: `backends/neuron/graph.py` and `backends/neuron/tp.py` trace under `neuron_target()`; while it is active the
`kernels="nki"` op table (`nki_ops.attention` / `nki_ops.mlp`) routes here. Without the Neuron SDK the first
kernel launch raises one sentence saying how to install it.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
from torch import nn

import nki_kernels
from neuron_infer.errors import BackendUnavailableError
from neuron_infer.tiling import TILE, tile_weight
from nki_kernels.attention_decode.kernel import attention_decode
from nki_kernels.attention_prefill.kernel import flash_attention_prefill
from nki_kernels.mlp.kernel import mlp_fp8_kernel, mlp_kernel

NKI_INSTALL_HINT = (
    "kernels='nki' on the neuron target needs the AWS Neuron SDK's nki package (NKI >= 0.6, installed with "
    "torch-neuronx and neuronx-cc from the Neuron pip repository https://pip.repos.neuron.amazonaws.com on a "
    "Trn2/Trn3 instance; the PyPI 'nki' is an empty placeholder), or use --kernels reference."
)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PARTITIONS = 128


def import_device_nki() -> Any:
    """The genuine Neuron `nki` module, or one clear sentence when only the simulator / a placeholder is present."""
    if nki_kernels.NKI_BACKEND != "neuron":
        raise BackendUnavailableError(NKI_INSTALL_HINT)
    import nki

    return nki


class Launcher:
    """Wraps each kernel once with `nki.jit` and launches it with the LNC grid (`jitted[lnc](*args)`)."""

    def __init__(self, nki_module: Any | None, lnc: int):
        if lnc not in (1, 2):
            raise BackendUnavailableError(f"a logical NeuronCore degree is 1 or 2, got {lnc!r}")
        self._nki, self.lnc = nki_module, lnc
        self._jitted: dict[Any, Any] = {}

    def launch(self, kernel, *args):
        """Run `kernel` (our module-level kernel; its plain function is re-wrapped by the SDK's jit) on `args`."""
        if self._nki is None:
            self._nki = import_device_nki()
        fn = getattr(kernel, "__wrapped__", kernel)   # the undecorated kernel function
        if fn not in self._jitted:
            self._jitted[fn] = self._nki.jit(fn)
        return self._jitted[fn][self.lnc](*args)


_ACTIVE: contextvars.ContextVar[Launcher | None] = contextvars.ContextVar("neuron_nki_launcher", default=None)


def active() -> Launcher | None:
    """The launcher of the neuron trace in progress, or None (then `kernels="nki"` runs on the CPU simulator)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def neuron_target(nki_module: Any | None = None, *, lnc: int):
    """While active, the `kernels="nki"` op table launches kernels through `nki_module.jit` (default: the SDK's)
    with the grid `lnc`, the degree the graph is compiled for (`backends/neuron/platform.py`)."""
    token = _ACTIVE.set(Launcher(nki_module, lnc))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _kernel_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in _KERNEL_DTYPES else torch.float32


def static_head_map(q_to_kv: torch.Tensor) -> tuple[int, ...]:
    """The constant query-to-KV head map as a static kernel argument (read once while tracing)."""
    return tuple(int(i) for i in q_to_kv.detach().to("cpu").tolist())


def attention(launcher: Launcher, q, k, v, q_to_kv, positions):
    """Causal GQA attention [B, Hq, T, D] through the prefill (T == S) or decode kernel."""
    dt = _kernel_dtype(q)
    qk, kk, vk = q.to(dt), k.to(dt), v.to(dt)
    t, s, d = q.shape[2], k.shape[2], q.shape[3]
    mapping, scale = static_head_map(q_to_kv), 1.0 / float(d) ** 0.5
    if t == s:
        qT = qk.transpose(2, 3).contiguous()                          # [B, Hq, D, T]
        kT = kk.transpose(2, 3).contiguous()                          # [B, Hkv, D, T]
        out = launcher.launch(flash_attention_prefill, qT, kT, vk.contiguous(), mapping, scale)
    else:
        out = _decode(launcher, qk, kk, vk, mapping, positions, scale)
    return out.to(q.dtype)                                            # [B, Hq, T, D]


def _decode(launcher, q, k, v, mapping, positions, scale):
    group = max(mapping.count(h) for h in set(mapping))
    chunk = max(1, PARTITIONS // group)                               # query tokens per launch: group*chunk <= 128
    kT = k.transpose(2, 3).contiguous()                               # [B, Hkv, D, S]
    vc = v.contiguous()                                               # [B, Hkv, S, D]
    outs = []
    for t0 in range(0, q.shape[2], chunk):
        qT = q[:, :, t0:t0 + chunk].transpose(2, 3).contiguous()      # [B, Hq, D, Tc]
        pos = positions[:, t0:t0 + chunk].to(torch.float32).contiguous()   # [B, Tc], exact below 2**24
        outs.append(launcher.launch(attention_decode, qT, kT, vc, pos, mapping, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)      # [B, Hq, T, D]


# ---------------------------------------------------------------------------------------------------------------
# MLP


def _tile_fp8(w_out_in: torch.Tensor) -> torch.Tensor:
    """FP8 [out, in] -> tiled W^T [128, N/128, K/128, 128] float8_e4m3fn (permuted as bytes: bit-exact)."""
    codes = w_out_in.view(torch.uint8).T                              # [K=in, N=out]
    return tile_weight(codes).view(torch.float8_e4m3fn)


def pack_scales(scale_n: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales [N] -> [128, ceil(N/128)] fp32, channel nt*128 + p at [p, nt] (pad 1.0); torch
    twin of `nki_kernels.mlp.reference.pack_scales` so it traces into the graph."""
    n = scale_n.shape[0]
    n_pad = -(-n // TILE) * TILE
    padded = torch.nn.functional.pad(scale_n.float(), (0, n_pad - n), value=1.0)   # [Np]
    return padded.reshape(n_pad // TILE, TILE).T.contiguous()                      # [Np/128, 128] -> [128, Np/128]


def _operands(kind: str, m: nn.Module, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The kernel operands of one projection, built with torch ops (traced into the graph)."""
    if kind == "tiled":
        if m.kind == "fp8":
            return m.weight, pack_scales(m.weight_scale)
        return (m.weight,)
    if kind == "fp8":
        return _tile_fp8(m.weight), pack_scales(m.weight_scale)
    return (tile_weight(m.weight.to(dt).T),)                         # [out, in] -> W [K=in, N=out], tiled


def mlp(launcher: Launcher, kind: str, x, gate, up, down):
    """down(silu(gate(x)) * up(x)) [B, T, H] through the fused kernel (`kind` from `nki_ops._kernel_kind`)."""
    mods = (gate, up, down)
    fp8 = kind == "fp8" or (kind == "tiled" and gate.kind == "fp8")
    if fp8:
        dt = torch.bfloat16                                           # FP8 weights multiply bf16 activations
    elif kind == "tiled":
        dt = gate.weight.dtype                                        # fp32 pairs with fp32, bf16 with bf16
    else:
        dt = _kernel_dtype(x)
    ops = [_operands(kind, m, dt) for m in mods]
    x2 = x.reshape(-1, x.shape[-1]).to(dt).contiguous()               # [B*T, H]
    if fp8:
        out = launcher.launch(mlp_fp8_kernel, x2, *(p[0] for p in ops), *(p[1] for p in ops))
    else:
        out = launcher.launch(mlp_kernel, x2, *(p[0] for p in ops))
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)                 # [B, T, H]
