"""The W8A8 GEMV kernel (backends/cpu/cpu_gemv_w8a8.cpp) against its PyTorch twin, inside real AOTInductor graphs.

Numerics: the kernel quantizes each activation row as the scheme does (s = max|x| / 127, round half to even,
clamp to +-127), sums the int8 products exactly in int32 and applies both fp32 scales in the reference's order, so
its output is bit-identical to quant.smoothquant.w8a8_matmul: checked with torch.equal on every shape. The integer
path itself is checked against the slow twin (fake-quantized activations and dequantized weights in fp32).
Every ISA level this CPU has is tested (AVX512-VNNI; AVX-512 and AVX2 multiply-adds, forced with gemv_isa), each
in its own process (see fresh_process.py). A whole w8a8 decode step: test_cpu_gemv_int8.py.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.errors import ArtifactError
from neuron_infer.quant.smoothquant import W8A8Linear, quantize_per_token
from tests.compile.fresh_process import run_check
from tests.compile.test_cpu_gemv import SHARED_CALLS, with_shared
from tests.compile.test_cpu_gemv_int8 import QuantLinears

ISAS = [isa for isa in ("avx512-vnni", "avx512", "avx2-vnni", "avx2") if cpu_gemv.has_isa(isa)]
needs_kernel = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX-512 nor AVX2")
# (R, N, K), rows 1..8 (the GEMV). K: whole 64-byte VNNI steps (64, 576), 32- and 16-element steps only (96, 48, 80), tails of
# every step size (100, 600, 200, 1544, 40, 31, 17) and K below one step (5, 20). Column groups (AVX-512: 4 weight
# rows per pass at 1-5 rows, 2 at 6-8; AVX2: 4 at 1-2, 2 at 3-5, 1 at 6-8; AVX-VNNI: 4 at 1, 3 at 2, 2 at 3-4, 1 at
# 5-8): N a multiple of the group, N leaving 1-3 single columns, N below the group. K = 32: one AVX-VNNI step.
# More rows (the GEMM: blocks of up to 8 rows x 2 weight rows with AVX-512, 5 x 2 with AVX2, 4 x 2 with AVX-VNNI):
# 9, 25 and 17 rows with N leaving a single column, 70 rows with a K tail.
SHAPES = [(1, 70, 64), (2, 33, 96), (3, 17, 100), (4, 130, 600), (5, 48, 576), (6, 9, 1544), (7, 40, 5),
          (8, 65, 200), (1, 257, 31), (2, 3, 48), (5, 37, 40), (1, 7, 20), (4, 1, 80), (3, 7, 48), (6, 2, 64),
          (7, 5, 17), (2, 8, 32), (2, 2, 33), (9, 70, 64), (25, 37, 600), (17, 131, 1544), (70, 33, 100)]


def W8A8Linears() -> QuantLinears:
    return QuantLinears(W8A8Linear, SHAPES)


def inputs() -> tuple[torch.Tensor, ...]:
    """Rows of different magnitudes (a wrong row scale shows), one all-zero row (the scale's floor), one row of
    exact ties (x / s = k + 1/2: round half to even, not away from zero)."""
    torch.manual_seed(1)
    xs = [(torch.randn(r, k) * torch.logspace(-1, 1, r)[:, None]).to(torch.bfloat16) for r, _, k in SHAPES]
    xs[3][2] = 0
    xs[0][0, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5])  # scale 1: ties round to even
    return tuple(xs)


def check_graph(out: str, isa: str) -> None:
    """The compiled graph's outputs are bit-identical to the eager module's (run in a fresh process)."""
    module = W8A8Linears().eval()
    assert json.loads((Path(out) / "lin.json").read_text())["gemv_kernel"]["isa"] == isa
    graph = CpuBackend().load_graph(Path(out), "lin", module)
    with torch.inference_mode():
        got, ref = graph(*inputs()), module(*inputs())
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.dtype == r.dtype == torch.bfloat16 and torch.equal(g, r), (isa, with_shared(SHAPES)[i])


@pytest.fixture(scope="module", params=ISAS)
def linears(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"w8a8-{request.param}")
    with torch.inference_mode():
        meta = CpuBackend(CpuCompileOptions(gemv_isa=request.param)).compile_graph(
            W8A8Linears().eval(), inputs(), out, "lin")
    return out, meta, request.param


def test_integer_path_equals_the_fake_quantized_float_twin():
    """w8a8_matmul (exact int32 sums, two fp32 scalings, one bf16 rounding) against the slow twin's values: the
    quantized activations and the dequantized weights as reference_forward builds them, multiplied in fp64. The
    fp32 roundings of the scalings move a result by far less than a bf16 step, so at least 97% of the outputs are
    bit-equal and every one is within one bf16 step (2^-7 relative at most); a wrong scale, row or tail is off by
    more. The twin's own operands are fp32-rounded (x * s and q * scale, 2^-24 relative each), so where the exact
    integer sum cancels to 0 the twin is off by up to 2^-23 of the sum of the products' magnitudes: that much more is
    allowed (a 4-row 600-wide shape has an exact 0 whose twin reads 6.5e-7, 2^-29 of its magnitude sum)."""
    module = W8A8Linears()
    xs = inputs()
    for lin, i in zip(module.lins, module.src):
        x = xs[i]  # [R, K]
        got = cpu_gemv.gemv_w8a8(x, [lin.weight], [lin.weight_scale]).float()
        xq, row_scale = quantize_per_token(x)
        xd, wd = (xq.float() * row_scale).double(), lin.dequantized_weight().double()  # [R, K], [N, K]
        twin = (xd @ wd.t()).to(torch.bfloat16).float()
        magnitude = (xd.abs() @ wd.abs().t()).float()  # [R, N]
        assert (got == twin).float().mean() >= 0.97
        assert ((got - twin).abs() <= twin.abs() * 2.0**-7 + magnitude * 2.0**-22 + 1e-30).all()


@needs_kernel
def test_compiled_kernel_is_bit_identical_on_every_shape(linears):
    out, meta, isa = linears
    assert meta["gemv_kernel"] and "lin.gemv.so" in meta["files"]
    run_check("tests.compile.test_cpu_gemv_w8a8", "check_graph", str(out), isa)


@needs_kernel
def test_graph_calls_the_c_function_not_the_dispatcher(linears):
    with zipfile.ZipFile(linears[0] / "lin.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    calls = len(SHAPES) + SHARED_CALLS
    assert wrapper.count("aoti_torch_cpu_ni_gemv_w8a8_v3(") == calls + 1  # the calls and the declaration
    assert "proxy_executor_call_function" not in wrapper and "_int_mm" not in wrapper


def _calls(options: CpuCompileOptions) -> int:
    program = cpu._export(W8A8Linears().eval(), inputs(), options)
    return sum(node.target is cpu_gemv.OPS["w8a8"] for node in program.graph.nodes)


def test_every_row_count_calls_the_kernel_and_cpus_without_avx2_keep_the_module_matmul(monkeypatch):
    assert _calls(CpuCompileOptions(gemv_kernel=False)) == 0
    if ISAS:
        calls = len(SHAPES) + SHARED_CALLS
        assert _calls(CpuCompileOptions()) == _calls(CpuCompileOptions(gemv_max_rows=2)) == calls
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert _calls(CpuCompileOptions()) == 0


def test_vnni_level_is_chosen_where_the_cpu_has_it(monkeypatch):
    avx512 = {"avx512f", "avx512bw", "avx512vl", "fma", "avx2"}
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset(avx512 | {"avx512_vnni"}))
    assert CpuCompileOptions().kernel_isa() == "avx512-vnni"
    assert CpuCompileOptions(gemv_isa="avx512").kernel_isa() == "avx512"
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset(avx512))  # Skylake-SP: no VNNI
    assert CpuCompileOptions().kernel_isa() == "avx512"
    assert "w8a8" in cpu_gemv.kernels_for("avx512") and "w8a8" in cpu_gemv.kernels_for("avx2")
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx_vnni"}))  # Alder Lake
    assert CpuCompileOptions().kernel_isa() == "avx2-vnni"
    assert CpuCompileOptions(gemv_isa="avx2").kernel_isa() == "avx2"
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset(avx512 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}))
    assert CpuCompileOptions().kernel_isa() == "avx512-bf16"  # Zen 5, Sapphire Rapids
    assert CpuCompileOptions(gemv_isa="avx2-vnni").kernel_isa() == "avx2-vnni"
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset(avx512 | {"avx512_vnni", "avx512_bf16"}))  # Zen 4
    assert CpuCompileOptions(gemv_isa="avx2-vnni").kernel_isa() == "avx2"  # the next level it has


@needs_kernel
def test_vnni_library_refused_on_a_cpu_without_vnni(linears, monkeypatch):
    out, _, isa = linears
    if isa not in ("avx512-vnni", "avx2-vnni"):
        pytest.skip("the VNNI libraries are the ones built for avx512-vnni and avx2-vnni")
    cpu_gemv._loaded.clear()  # a library already loaded in this process is not checked again
    # the same CPU without VNNI: Skylake-SP for the AVX-512 library, Haswell for the AVX2 one
    without = {"avx512f", "avx512bw", "avx512vl", "fma", "avx2"} if isa == "avx512-vnni" else {"avx2", "fma"}
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset(without))
    flag = "avx512_vnni" if isa == "avx512-vnni" else "avx_vnni"
    with pytest.raises(ArtifactError, match=f"needs a CPU with .*{flag}"):
        CpuBackend().load_graph(out, "lin", W8A8Linears().eval())




def test_libraries_without_a_quantized_kernel_do_not_need_vnni():
    """The bf16 and attention kernels are the same code at avx512 and avx512-vnni (avx2 and avx2-vnni): their
    graphs stay loadable on CPUs without VNNI (Skylake-SP; AVX2 CPUs before Alder Lake and Zen 5). The int8
    (vpdpwssd) and w8a8 (vpdpbusd) kernels use VNNI there."""
    assert cpu_gemv.lowest_isa(("bf16",), "avx512-vnni") == cpu_gemv.lowest_isa(("bf16", "attn"), "avx512-vnni") \
        == "avx512"
    assert cpu_gemv.lowest_isa(("bf16", "w8a8"), "avx512-vnni") == "avx512-vnni"
    assert cpu_gemv.lowest_isa(("bf16", "int8"), "avx512-vnni") == "avx512-vnni"
    assert cpu_gemv.lowest_isa(("bf16",), "avx512-bf16") == "avx512-bf16"
    assert cpu_gemv.lowest_isa(("int8",), "avx2") == "avx2"
    assert cpu_gemv.lowest_isa(("bf16", "attn"), "avx2-vnni") == "avx2"
    assert cpu_gemv.lowest_isa(("bf16", "int8"), "avx2-vnni") == cpu_gemv.lowest_isa(("w8a8",), "avx2-vnni") \
        == "avx2-vnni"
