"""Cases for scripts/run_aws_nki_kernels.py: which file/kernel of an AWS checkout to run, on which inputs, against
which reference. No AWS code is copied here; paths name files in the user's checkout."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    repo: str                       # "sdk" | "nki-library"
    run: Callable                   # run(root, load, rng): raises AssertionError("mismatch ...") on a wrong result
    kernel: str = ""                # the kernel this case exercises when several cases share one ("" = name)

    @property
    def kernel_name(self) -> str:
        return self.kernel or self.name


def check(got, ref, rtol, atol, what=""):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"mismatch {what}: shape {got.shape} vs reference {ref.shape}")
    if not np.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True):
        err = np.nanmax(np.abs(got - ref))
        raise AssertionError(f"mismatch {what}: max abs error {err:.3g} (rtol {rtol}, atol {atol})")


@contextlib.contextmanager
def target(name):
    """Run under NEURON_PLATFORM_TARGET_OVERRIDE=name (restored afterwards; some example files set it on import)."""
    old = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = old


def simulate(kernel, *args, lnc=None, **kwargs):
    import nki
    if lnc is not None and not hasattr(kernel, "__getitem__"):   # a plain (sub)kernel function: wrap it first
        kernel = nki.jit(kernel)
    k = kernel if lnc is None else kernel[lnc]
    return nki.simulate(k)(*args, **kwargs)


EX = "nki/examples"


def _sdk_add(rel, kernel_name, shape, dtype=np.float32):
    def run(root, load, rng):
        with target("trn2"):
            mod = load(root / EX / rel)
            with target("trn2"):
                a, b = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
                out = simulate(getattr(mod, kernel_name), a, b)
        check(out, a.astype(np.float32) + b.astype(np.float32), 1e-2 if dtype != np.float32 else 1e-6, 1e-2)
    return run


def _sdk_simulate_example(root, load, rng):
    with target("trn3"):
        load(root / EX / "simulate" / "nki_simulate_example.py")   # the file runs and asserts its own check


def _sdk_matmul(kernel_name, k, m, n):
    def run(root, load, rng):
        mod = load(root / EX / "matrix_multiplication" / "matrix_multiplication_nki_kernels.py")
        lhs_t = rng.random((k, m)).astype(BF16)
        rhs = rng.random((k, n)).astype(BF16)
        with target("trn2"):
            out = simulate(getattr(mod, kernel_name), lhs_t, rhs)
        ref = lhs_t.astype(np.float32).T @ rhs.astype(np.float32)
        check(np.asarray(out, np.float32), ref, 1e-2, 0.5)   # bf16 output of an fp32 K-sum (K <= 2048)
    return run


def _sdk_transpose2d(root, load, rng):
    mod = load(root / EX / "transpose2d" / "transpose2d_nki_kernels.py")
    x = rng.standard_normal((16, 12)).astype(np.float32)
    with target("trn2"):
        out = simulate(mod.tensor_transpose2D_kernel_, x, (3, 4))
    check(out, x.reshape(16, 3, 4).transpose(0, 2, 1).reshape(16, 12), 0, 0)


def _sdk_avgpool(root, load, rng):
    mod = load(root / EX / "average_pool2d" / "average_pool2d_nki_kernels.py")
    x = rng.standard_normal((2, 6, 6)).astype(np.float32)
    with target("trn2"):
        out = simulate(mod.tensor_avgpool_kernel, x, 2)
    check(out, mod.np_average_pool_2D(x, 2), 1e-6, 1e-6)


def _mamba_reference(delta, u, a, b, c):
    """The documented SSM: state[t] = exp(delta*A) * state[t-1] + delta*B*u; y = sum_state C * state."""
    d_a = np.exp(delta[:, :, None, :] * a[None, :, :, None])            # [B, C, S, L]
    d_bu = delta[:, :, None, :] * b[:, None, :, :] * u[:, :, None, :]   # [B, C, S, L]
    state = np.zeros(d_a.shape[:-1])
    out = np.empty_like(d_a)
    for t in range(d_a.shape[-1]):
        state = d_a[..., t] * state + d_bu[..., t]
        out[..., t] = state
    return (c[:, None, :, :] * out).sum(axis=2)


def _sdk_mamba(kernel_name):
    def run(root, load, rng):
        mod = load(root / EX / "fused_mamba" / "mamba_nki_kernels.py")
        bsz, ch, st, sl = 1, 256, 4, 512
        delta = rng.random((bsz, ch, sl)).astype(np.float32) * 0.5
        u = rng.standard_normal((bsz, ch, sl)).astype(np.float32)
        a = -rng.random((ch, st)).astype(np.float32)
        b, c = (rng.standard_normal((bsz, st, sl)).astype(np.float32) for _ in range(2))
        with target("trn2"):
            out = simulate(getattr(mod, kernel_name), delta, u, a, b, c)
        check(out, _mamba_reference(*(v.astype(np.float64) for v in (delta, u, a, b, c))), 1e-4, 1e-4)
    return run


def _sdk_index_split(root, load, rng):
    mod = load(root / EX / "index-case-1.py")
    x = rng.standard_normal((4, 5)).astype(np.float32)
    with target("trn2"):
        even, odd = simulate(mod.tensor_split_kernel_, x)
    check(even, x[:, 0::2], 0, 0)
    check(odd, x[:, 1::2], 0, 0)


def _sdk_maxpool(root, load, rng):
    mod = load(root / EX / "index-case-3.py")
    x = rng.standard_normal((2, 6, 6)).astype(np.float32)
    with target("trn2"):
        out = simulate(mod.tensor_maxpool_kernel_, x, 2)
    check(out, x.reshape(2, 3, 2, 3, 2).max(axis=(2, 4)), 0, 0)


def _sdk_layout_exp(root, load, rng):
    mod = load(root / EX / "layout-pass.py")
    x = rng.standard_normal((128, 512)).astype(np.float32)
    with target("trn2"):
        out = simulate(mod.tensor_exp_kernel_, x)
    check(out, np.exp(x), 1e-6, 1e-6)


MX = "nki/deep-dives/src/mxfp-matmul"


def _sdk_mx(variant):
    def run(root, load, rng):
        utils = load(root / MX / "mx_cpu_utils.py", "mx_cpu_utils")
        mod = load(root / MX / "mx_kernels.py")
        import nki.language as nl
        m, k, n = 128, 128, 512
        q = ml_dtypes.float8_e4m3fn
        x4 = nl.float8_e4m3fn_x4
        with target("trn3"):
            _, _, st_x4, st_scale = utils.generate_stabilized_mx_data(q, (k, m * 4))
            if variant == "offline":
                _, _, mv_x4, mv_scale = utils.generate_stabilized_mx_data(q, (k, n * 4))
                out = simulate(mod.kernel_offline_quantized_mx_matmul, st_x4, st_scale, mv_x4, mv_scale, x4)
                ref = utils.nc_matmul_mx_golden(st_x4, mv_x4, st_scale, mv_scale, q, q)
            elif variant == "on_device":   # stabilised data: exactly representable after MX quantisation
                mv = utils.generate_stabilized_mx_data(q, (k, n * 4))[0]
                out = simulate(mod.kernel_on_device_quantize_matmul_mx, st_x4, st_scale, mv.astype(BF16), x4, x4)
                mv_x4, mv_scale = utils.quantize_mx_golden(mv, q)
                ref = utils.nc_matmul_mx_golden(st_x4, mv_x4, st_scale, mv_scale, q, q)
            else:
                st = utils.generate_stabilized_mx_data(q, (4 * k, m))[0]
                mv = utils.generate_stabilized_mx_data(q, (4 * k, n))[0]
                fn = (mod.kernel_copy_strided_quantize_matmul_mx if variant == "strided"
                      else mod.kernel_copy_strided_quantize_matmul_mx_packed_scale)
                out = simulate(fn, st.astype(BF16), mv.astype(BF16), x4)
                ref = st.T @ mv
        check(np.asarray(out, np.float32), ref, 5e-2, 5e-2, variant)   # the deep dive's own tolerance
    return run


SDK_CASES = [
    Case("sdk/tensor_addition/nki_tensor_add", "sdk",
         _sdk_add("tensor_addition/tensor_addition_nki_kernels.py", "nki_tensor_add", (256, 1024))),
    Case("sdk/getting_started/nki_tensor_add_kernel", "sdk",
         _sdk_add("getting_started_torch.py", "nki_tensor_add_kernel", (4, 3), np.float16)),
    Case("sdk/getting_started_baremetal/nki_tensor_add_kernel", "sdk",
         _sdk_add("getting_started_baremetal.py", "nki_tensor_add_kernel", (4, 3), np.float16)),
    Case("sdk/getting_started_jax/nki_tensor_add_kernel", "sdk",
         _sdk_add("getting_started_jax.py", "nki_tensor_add_kernel", (4, 3), np.float16)),
    Case("sdk/simulate/add_kernel", "sdk", _sdk_simulate_example),
    Case("sdk/matmul/nki_matmul_basic_", "sdk", _sdk_matmul("nki_matmul_basic_", 128, 64, 512)),
    Case("sdk/matmul/nki_matmul_tiled_", "sdk", _sdk_matmul("nki_matmul_tiled_", 256, 256, 1024)),
    Case("sdk/matmul/nki_matmul_hoist_load_", "sdk", _sdk_matmul("nki_matmul_hoist_load_", 256, 256, 1024)),
    Case("sdk/matmul/nki_matmul_block_free_dimension_", "sdk",
         _sdk_matmul("nki_matmul_block_free_dimension_", 256, 512, 2048)),
    Case("sdk/matmul/nki_matmul_fully_optimized_", "sdk",
         _sdk_matmul("nki_matmul_fully_optimized_", 1024, 2048, 1024)),
    Case("sdk/transpose2d/tensor_transpose2D_kernel_", "sdk", _sdk_transpose2d),
    Case("sdk/average_pool2d/tensor_avgpool_kernel", "sdk", _sdk_avgpool),
    Case("sdk/fused_mamba/mamba_v1", "sdk", _sdk_mamba("mamba_v1")),
    Case("sdk/fused_mamba/mamba_v2", "sdk", _sdk_mamba("mamba_v2")),
    Case("sdk/fused_mamba/mamba_v3", "sdk", _sdk_mamba("mamba_v3")),
    Case("sdk/index-case-1/tensor_split_kernel_", "sdk", _sdk_index_split),
    Case("sdk/index-case-3/tensor_maxpool_kernel_", "sdk", _sdk_maxpool),
    Case("sdk/layout-pass/tensor_exp_kernel_", "sdk", _sdk_layout_exp),
    Case("sdk/mxfp-matmul/kernel_offline_quantized_mx_matmul", "sdk", _sdk_mx("offline")),
    Case("sdk/mxfp-matmul/kernel_on_device_quantize_matmul_mx", "sdk", _sdk_mx("on_device")),
    Case("sdk/mxfp-matmul/kernel_copy_strided_quantize_matmul_mx", "sdk", _sdk_mx("strided")),
    Case("sdk/mxfp-matmul/kernel_copy_strided_quantize_matmul_mx_packed_scale", "sdk", _sdk_mx("packed")),
]



def all_cases():
    from aws_nkilib_cases import LIB_CASES  # imports this module's Case/check/simulate/target
    return SDK_CASES + LIB_CASES
