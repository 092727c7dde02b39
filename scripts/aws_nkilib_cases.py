"""nki-library cases for scripts/run_aws_nki_kernels.py: each runs one kernel of a user's nki-library checkout
(``src/nkilib_src`` on sys.path) on small inputs shaped like the library's own fast tests and compares it with the
torch reference the library publishes next to the kernel (``*_torch.py``). No nki-library code is copied here."""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import ml_dtypes
import numpy as np
from aws_nki_cases import Case, simulate, target

BF16 = ml_dtypes.bfloat16


def _to_torch(value):
    """numpy -> torch as the library's reference wrapper does: bf16/fp8 -> fp32, uint32 -> int32."""
    import torch
    if not isinstance(value, np.ndarray):
        return value
    if "bfloat16" in str(value.dtype) or "float8" in str(value.dtype) or value.dtype == np.float16:
        value = value.astype(np.float32)
    elif value.dtype == np.uint32:
        value = value.astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(value))


def _to_numpy(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().float().numpy() if value.is_floating_point() else value.detach().numpy()
    return np.asarray(value)


def check_max(got, ref, rtol, atol, what=""):
    """nki-library's own acceptance rule: |got - ref| <= atol + rtol * max|ref| (its comparator's "max" mode)."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        if got.size != ref.size:
            raise AssertionError(f"mismatch {what}: shape {got.shape} vs reference {ref.shape}")
        got = got.reshape(ref.shape)
    scale = np.nanmax(np.abs(ref)) if ref.size else 0.0
    err = np.abs(got - ref)
    if not np.all((err <= atol + rtol * scale) | (np.isnan(got) & np.isnan(ref))):
        raise AssertionError(f"mismatch {what}: max abs error {np.nanmax(err):.3g} > {atol} + {rtol} * {scale:.3g}")


def reference(fn: Callable, inputs: dict) -> list:
    """Call a torch reference with the inputs it names; its outputs in their order (dict values or one tensor)."""
    params = inspect.signature(fn).parameters
    result = fn(**{k: _to_torch(v) for k, v in inputs.items() if k in params})
    if isinstance(result, dict):
        return [_to_numpy(v) for v in result.values()]
    if isinstance(result, (tuple, list)):
        return [_to_numpy(v) for v in result]
    return [_to_numpy(result)]


def lib(name: str, kernel: str, ref: str, make_inputs: Callable, rtol: float, atol: float, *, lnc: int = 2,
        platform: str = "trn2", outputs: slice | None = None, compare: Callable | None = None) -> Case:
    """kernel / ref: "module.path:function" under nkilib. make_inputs(rng) -> kernel keyword arguments.
    outputs selects which of the kernel's returned tensors (and the reference's, in the same order) are compared."""
    def run(root, load, rng):
        kmod, kfn = kernel.split(":")
        rmod, rfn = ref.split(":")
        kernel_fn = getattr(importlib.import_module("nkilib." + kmod), kfn)
        ref_fn = getattr(importlib.import_module("nkilib." + rmod), rfn)
        inputs = make_inputs(rng)
        with target(platform):
            got = simulate(kernel_fn, lnc=lnc, **inputs)
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        want = reference(ref_fn, inputs)
        if compare is not None:
            compare(got, want, inputs)
            return
        sel = outputs or slice(None)
        got, want = got[sel], want[sel]
        if len(got) != len(want):
            raise AssertionError(f"mismatch: kernel returned {len(got)} outputs, reference {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            check_max(g, w, rtol, atol, f"output {i}")
    return Case("nki-library/" + name, "nki-library", run)


def _randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


LIB_CASES = [
    lib("cumsum", "core.cumsum.cumsum:cumsum", "core.cumsum.cumsum_torch:cumsum_torch_ref",
        lambda rng: {"x": _randn(rng, (64, 4, 1024), BF16)}, 1e-2, 1e-3),
    lib("cascaded_max", "core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
        lambda rng: {"input_tensor": _randn(rng, (4, 5, 4058))}, 1e-5, 1e-5, lnc=1),
    lib("cascaded_max_lnc2", "core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
        lambda rng: {"input_tensor": _randn(rng, (8, 5, 4058))}, 1e-5, 1e-5, lnc=2),
    lib("rope", "core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref",
        lambda rng: {"x_in": _randn(rng, (64, 1, 8, 16), BF16), "cos": _randn(rng, (32, 1, 16), BF16),
                     "sin": _randn(rng, (32, 1, 16), BF16), "lnc_shard": True, "contiguous_layout": True,
                     "relayout_in_sbuf": False}, 2**-7, 1e-3),
    lib("rope_interleaved", "core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref",
        lambda rng: {"x_in": _randn(rng, (128, 8, 1, 128), BF16), "cos": _randn(rng, (64, 8, 128), BF16),
                     "sin": _randn(rng, (64, 8, 128), BF16), "lnc_shard": True, "contiguous_layout": False,
                     "relayout_in_sbuf": True}, 2**-7, 1e-3),
    lib("rope_hf", "core.embeddings.rope_hf:rope_hf", "core.embeddings.rope_hf_torch:rope_hf_torch_ref",
        lambda rng: _rope_hf_inputs(rng, 1, 4, 2, 256, 128, np.float32), 1e-6, 1e-6),
    lib("rmsnorm_tkg", "core.subkernels.rmsnorm_tkg:rmsnorm_tkg",
        "core.subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref",
        lambda rng: _norm_inputs(rng, 2, 8, 8192, np.float16), 2e-2, 1e-5),
    lib("rmsnorm_tkg_lnc1", "core.subkernels.rmsnorm_tkg:rmsnorm_tkg",
        "core.subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1",
        lambda rng: _norm_inputs(rng, 1, 4, 2048, np.float16, hidden_actual=1920), 2e-2, 1e-5, lnc=1),
    lib("layernorm_tkg", "core.subkernels.layernorm_tkg:layernorm_tkg",
        "core.subkernels.layernorm_torch:layernorm_tkg_torch_ref",
        lambda rng: _norm_inputs(rng, 2, 8, 8192, np.float16, beta=True), 2e-2, 1e-5),
    lib("layernorm_tkg_lnc1", "core.subkernels.layernorm_tkg:layernorm_tkg",
        "core.subkernels.layernorm_torch:layernorm_tkg_torch_ref_lnc1",
        lambda rng: _norm_inputs(rng, 1, 8, 8192, np.float16, beta=True), 2e-2, 1e-5, lnc=1),
    lib("find_nonzero_indices", "core.subkernels.find_nonzero_indices:find_nonzero_indices",
        "core.subkernels.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
        lambda rng: {"input_tensor": _sparse(rng, 4096, 128, 8, np.float32), "chunk_size": 4096}, 0, 0),
    lib("find_nonzero_indices_cols", "core.subkernels.find_nonzero_indices:find_nonzero_indices",
        "core.subkernels.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
        lambda rng: {"input_tensor": _sparse(rng, 4096, 128, 8, np.int32), "col_start_id": np.array([16], np.int32),
                     "n_cols": 16, "chunk_size": 4096}, 0, 0),
    lib("indexed_flatten", "core.subkernels.indexed_flatten:indexed_flatten",
        "core.subkernels.indexed_flatten_torch:indexed_flatten_torch_ref", lambda rng: _flatten_inputs(4096, 3, 128),
        0, 0),
]


def _rope_hf_inputs(rng, b, hq, hkv, s, d, dtype):
    q, k = _randn(rng, (b, hq, s, d), dtype), _randn(rng, (b, hkv, s, d), dtype)
    return {"q": q, "k": k, "q_out": np.zeros_like(q), "k_out": np.zeros_like(k), "cos": _randn(rng, (b, s, d), dtype),
            "sin": _randn(rng, (b, s, d), dtype), "backward": False}


def _norm_inputs(rng, b, s, h, dtype, hidden_actual=None, beta=False):
    out = {"input": _randn(rng, (b, s, h), dtype), "gamma": _randn(rng, (1, h), dtype),
           "output": np.zeros((128, b * s, h // 128), dtype)}
    if beta:
        out["beta"] = _randn(rng, (1, h), dtype)
    elif hidden_actual is not None:
        out["hidden_actual"] = hidden_actual
    return out


def _sparse(rng, t, e, top_k, dtype):
    """[T, E] routing mask with T*top_k/E nonzeros per column (the library test's sparsity)."""
    k = t * top_k // e
    flat = rng.permutation(np.concatenate([np.ones(k * e), np.zeros((t - k) * e)]))
    out = flat.reshape(e, t).T.astype(dtype)
    if dtype == np.float32:
        out[out > 0] = 0.1
    return out


def _flatten_inputs(t, e, f_len):
    out_len = ((e * t + 1024 + 127) // 128) * 128
    return {"input_tensor": np.arange(e * t, dtype=np.int32).reshape(e, t), "f_len": f_len, "output_len": out_len,
            "row_offsets": np.array([t // f_len * i for i in range(e)], np.int32), "row_offsets_start": None,
            "padding_val": -1}
