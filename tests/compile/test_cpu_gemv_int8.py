"""The int8-weight GEMV kernel (backends/cpu/cpu_gemv_int8.cpp) against its PyTorch twin, inside real AOTInductor graphs.

Numerics: weight-only int8, integer dot products on 16-bit activations. The kernel puts each activation row on a
power-of-two grid (|xi| <= 32767), sums q * xi exactly and scales once; `kernel_model` below
is that computation in PyTorch, and the kernel must equal it bit for bit (a kernel dropping a K tail, mixing rows,
misreading a stride or a scale, mixing the blocks of a GEMM, or overflowing an int32 lane does not). Against
dequantize-then-matmul summed exactly (fp64): an element within 2^8 of its row's largest is on the grid exactly and a
smaller one moves by at most half a grid step (2^-16 of the row's largest), so each output is within the grid's own
error (sum over k of |x - grid(x)| * |q| * scale, computed exactly) plus one bf16 step of the exact result (its one
rounding; a bias adds a second). That error is far below a bf16 step except where an output nearly cancels to zero.
A row holding Inf or NaN gives NaN. Past 64 rows, at the AVX512-BF16 level only (oneDNN's bf16 GEMM is fast there and
several times slower than the blocks below it), the kernel widens the weights to bf16 for ATen's GEMM and scales
the rounded product (bf16(bf16(x @ q^T) * scale), the int8 module's own forward): two roundings of an fp32 sum, so
within two bf16 steps of the exact product plus an fp32 sum's error bound (test_cpu_gemv.assert_within_fp32_sums).
Every ISA level is tested on CPUs that have it (AVX512-BF16, AVX512-VNNI, AVX-512, AVX-VNNI, AVX2; the lower ones forced with
gemv_isa), each in its own process (fresh_process.py).
"""
from __future__ import annotations

import copy
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.config import QuantConfig
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.ops import Ops
from neuron_infer.quant import apply_quantization
from neuron_infer.quant.int8 import Int8Linear
from neuron_infer.quant.smoothquant import W8A8Linear
from tests.compile.fresh_process import run_check
from tests.compile.test_cpu_backend import S, empty_cache, tg_args, tiny_model
from tests.compile.test_cpu_gemv import (
    SHARED_CALLS,
    assert_one_rounding_apart,
    assert_within_fp32_sums,
    gemm_max_rows,
    sources,
    with_shared,
)

ISAS = [isa for isa in ("avx512-bf16", "avx512-vnni", "avx512", "avx2-vnni", "avx2") if cpu_gemv.has_isa(isa)]
needs_int8 = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX-512 nor AVX2")
# (R, N, K): K multiples of 64, of 16 only, 8-element and 4-element tails, K < 8; rows 1..8 (the GEMV). Column
# groups (AVX2 and AVX-VNNI: 4 weight rows per pass at 1-2 rows, 2 at 3-6; AVX-512: 4 at 1-5 rows, 3 at 6-8): N a multiple of
# the group, N leaving every possible number of single columns (AVX2: 33, 70, 7 at 1-2 rows, 17, 9, 37 at 3-6;
# AVX-512: 17, 130, 7 at 3-5 rows, 40, 65 at 6-8), N below the group (3 at 2 rows, 1 at 4, 2 at 6, 4 at 7 on AVX2's
# single columns), with and without K tails; K = 8300 sums in more than one int32 run (8192 weights with AVX-512,
# 4096 with AVX2). More than 8 rows (the GEMM: blocks of 8 rows x 3 columns with AVX-512, 6 x 2 with AVX2, up to 64
# rows): 9 rows (two blocks), 25 (blocks of 7/6 or 5), 17 with N leaving single columns at both widths, 40 rows with
# N below a group and two int32 runs, 64; past 64 rows (ATen's GEMM on the widened weights at the AVX512-BF16 level,
# the blocks below it): 65 and 300.
SHAPES = [(1, 70, 64), (2, 33, 96), (3, 17, 100), (4, 130, 600), (5, 48, 576), (6, 9, 1544), (7, 40, 5), (8, 65, 200),
          (1, 257, 31), (2, 3, 48), (5, 37, 40), (1, 7, 20), (4, 1, 24), (3, 7, 48), (6, 2, 64), (7, 4, 48),
          (2, 5, 8300), (9, 70, 64), (25, 37, 600), (17, 131, 1544), (40, 2, 8300), (64, 33, 96), (65, 9, 200),
          (300, 41, 600)]
NONFINITE = 3  # the input (4 rows) whose first two rows get a NaN and an Inf, the third 2^-110 x, in check_graph


class QuantLinears(torch.nn.Module):
    """One quantized linear (`cls`: Int8Linear, W8A8Linear) per (R, N, K) shape, each fed by its own [R, K] bf16
    input (a bias on the second), then the SHARED linears (test_cpu_gemv.py)."""

    def __init__(self, cls=Int8Linear, shapes=None):
        super().__init__()
        torch.manual_seed(0)
        shapes = shapes or SHAPES
        lins = [torch.nn.Linear(k, n, bias=i == 1).to(torch.bfloat16) for i, (_, n, k) in enumerate(with_shared(shapes))]
        for lin in lins:  # per-channel magnitudes spanning 100x, so a wrong scale index shows
            with torch.no_grad():
                lin.weight.mul_(torch.logspace(-1, 1, lin.out_features, dtype=torch.bfloat16)[:, None])
        self.lins = torch.nn.ModuleList(cls.from_linear(lin) for lin in lins)
        self.src = sources(shapes)
        self.ops = Ops(name="reference")  # the CPU backend traces with its table: kernel calls

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.ops.linear(lin, xs[i]) for lin, i in zip(self.lins, self.src))


Int8Linears = QuantLinears


def inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    return tuple(torch.randn(r, k).to(torch.bfloat16) for r, _, k in SHAPES)


def kernel_model(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in PyTorch: x [R, K] bf16, q [N, K] int8, scale [N] bf16 -> [R, N] bf16. Each row
    on the grid 2^e (e the smallest >= -120 with max|x| 2^-e <= 32767), the products summed exactly, then
    fp32(sum) * 2^e * scale, rounded once."""
    rows = []
    for row in x.float():
        if not row.isfinite().all():
            rows.append(torch.full((q.shape[0],), math.nan))
            continue
        e = grid_exponent(row)
        xi = torch.round(row * 2.0**-e).to(torch.int64)  # the fp32 product is exact; round half to even
        rows.append((xi @ q.to(torch.int64).t()).float() * 2.0**e * scale.float())
    return torch.stack(rows).to(torch.bfloat16)


def grid_exponent(row: torch.Tensor) -> int:
    """The kernel's grid exponent for one finite row: the smallest e >= -120 with max|x| 2^-e <= 32767."""
    peak, e = row.abs().max().item(), -120
    while math.ldexp(peak, -e) > 32767:
        e += 1
    return e


def assert_within_grid_error(got: torch.Tensor, x: torch.Tensor, lin: Int8Linear) -> None:
    """got [R, N] against dequantize-then-matmul summed in fp64: within the grid's error plus one bf16 step per
    rounding (see the module docstring)."""
    w = lin.weight.double() * lin.weight_scale.double()[:, None]  # [N, K], exact
    grids = torch.stack([torch.full_like(row, 2.0 ** grid_exponent(row)) for row in x.double()])  # [R, K]
    moved = (x.double() - torch.round(x.double() / grids) * grids).abs()  # [R, K]: |x - grid(x)|, exact
    exact = x.double() @ w.t()  # [R, N]
    bound = moved @ w.abs().t()  # [R, N]
    roundings = 1
    if lin.bias is not None:
        exact, roundings = exact + lin.bias.double(), 2
    step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1e-30)).exponent - 8)
    assert bool(((got.double() - exact).abs() <= bound + roundings * step).all())


def reference(module: Int8Linears, xs, model: bool = False) -> list[torch.Tensor]:
    """Every linear's output by the op's reference, or (model) by kernel_model."""
    out = []
    for lin, i in zip(module.lins, module.src):
        if model:
            y = kernel_model(xs[i], lin.weight, lin.weight_scale)
        else:
            y = cpu_gemv.gemv_int8(xs[i], [lin.weight], [lin.weight_scale])
        out.append(y if lin.bias is None else y + lin.bias)
    return out


@pytest.fixture(scope="module", params=ISAS)
def linears(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"gemv8-{request.param}")
    module = Int8Linears().eval()
    with torch.inference_mode():
        meta = CpuBackend(CpuCompileOptions(gemv_isa=request.param)).compile_graph(module, inputs(), out, "lin")
    return out, module, meta, request.param


def test_reference_is_dequantize_then_matmul():
    torch.manual_seed(2)
    lin = Int8Linear.from_linear(torch.nn.Linear(100, 20, bias=False))
    x = torch.randn(3, 100).to(torch.bfloat16)
    exact = (x.double() @ lin.dequantized_weight().double().t()).to(torch.bfloat16)  # fp64 sum, one rounding
    assert_one_rounding_apart(cpu_gemv.gemv_int8(x, [lin.weight], [lin.weight_scale]), exact)


def check_graph(out: str, isa: str) -> None:
    """The compiled graph on every shape: bit-equal to kernel_model, within the grid's error of exact
    dequantize-then-matmul; rows holding NaN or Inf give NaN (run in a fresh process: fresh_process.py)."""
    module = Int8Linears().eval()
    assert json.loads((Path(out) / "lin.json").read_text())["gemv_kernel"]["isa"] == isa
    graph = CpuBackend().load_graph(Path(out), "lin", module)
    xs = inputs()
    with torch.inference_mode():
        got = graph(*xs)
        model = reference(module, xs, model=True)
    for g, m, lin, i in zip(got, model, module.lins, module.src):
        if xs[i].shape[0] > gemm_max_rows(isa):  # the weights widened to bf16, ATen's GEMM, the scale after
            assert_within_fp32_sums(g, xs[i], lin.dequantized_weight(), lin.bias, roundings=2)
            continue
        assert torch.equal(g, m)
        assert_within_grid_error(g, xs[i], lin)
    bad = list(xs)
    bad[NONFINITE] = bad[NONFINITE].clone()
    bad[NONFINITE][0, 5], bad[NONFINITE][1, 7] = math.nan, math.inf
    bad[NONFINITE][2] *= 2.0**-110  # a row so small its grid exponent is clamped at -120 (a coarser grid)
    with torch.inference_mode():
        got = graph(*bad)
        model = reference(module, bad, model=True)
    for g, i, m in zip(got, module.src, model):
        if i == NONFINITE:
            assert g[:2].isnan().all() and m[:2].isnan().all() and torch.equal(g[2:], m[2:])
            assert g[2].abs().max() > 0  # the small row keeps its values on the coarser grid


@needs_int8
def test_compiled_kernel_equals_reference_on_every_shape(linears):
    out, _, meta, isa = linears
    assert meta["gemv_kernel"] and "lin.gemv.so" in meta["files"]
    run_check("tests.compile.test_cpu_gemv_int8", "check_graph", str(out), isa)


@needs_int8
def test_graph_calls_the_c_function_not_the_dispatcher(linears):
    out = linears[0]
    with zipfile.ZipFile(out / "lin.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_ni_gemv_int8_v6(") >= len(SHAPES) + SHARED_CALLS
    assert "proxy_executor_call_function" not in wrapper


@needs_int8
@pytest.mark.parametrize("scheme,bound", [("int8", 0.1), ("w8a8", 0.2)])
def test_quantized_token_generation_graph_is_as_accurate_as_eager(tmp_path, scheme, bound):
    """A whole int8 or w8a8 decode step (2 rows) through its kernel against the same int8 weights dequantized and
    computed in fp32 (w8a8: without activation quantization). Criterion: no further from it than the eager module
    is (up to 1.5x; both round activations to bf16 between ops, eager int8 rounds the matmul before the scale, and
    for w8a8 one bf16 difference in a linear's input can move an activation to the next int8 step); a broken
    kernel is off by O(1)."""
    model = tiny_model().to(torch.bfloat16)
    apply_quantization(model, QuantConfig(scheme=scheme))
    exact = copy.deepcopy(model)
    for name, mod in list(exact.named_modules()):
        if isinstance(mod, (Int8Linear, W8A8Linear)):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            lin.weight.data = mod.dequantized_weight()
            if mod.bias is not None:
                lin.bias.data = mod.bias.float()
            exact.set_submodule(name, lin)
    exact.float()
    k, v = (t.to(torch.bfloat16) for t in empty_cache(model))
    with torch.inference_mode():
        meta = CpuBackend().compile_graph(BucketStep(model, S), tg_args(k, v, 0), tmp_path, "tg")
        graph = CpuBackend().load_graph(tmp_path, "tg", BucketStep(model, S))
        got = graph(*tg_args(k.clone(), v.clone(), 0)).float()
        eager = BucketStep(model, S)(*tg_args(k.clone(), v.clone(), 0)).float()
        ref = BucketStep(exact, S)(*tg_args(k.float(), v.float(), 0))
    assert meta["gemv_kernel"]
    with zipfile.ZipFile(tmp_path / "tg.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert f"{cpu_gemv._SYMBOLS[scheme]}(" in wrapper
    eager_err = (eager - ref).abs().max().item()
    assert 0 < eager_err < bound
    assert (got - ref).abs().max().item() <= 1.5 * eager_err
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _calls(options: CpuCompileOptions) -> int:
    module, xs = Int8Linears().eval(), inputs()
    program = cpu._export(module, xs, options)
    return sum(node.target is cpu_gemv.OPS["int8"] for node in program.graph.nodes)


def test_options_and_cpus_without_the_isa_keep_the_module_matmul(monkeypatch):
    assert _calls(CpuCompileOptions(gemv_kernel=False)) == 0
    assert _calls(CpuCompileOptions(gemv_max_rows=0)) == 0
    if ISAS:
        calls = len(SHAPES) + SHARED_CALLS  # any row count, whatever gemv_max_rows (> 0) says
        assert _calls(CpuCompileOptions()) == _calls(CpuCompileOptions(gemv_max_rows=2)) == calls
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert CpuCompileOptions().kernel_isa() is None and not CpuCompileOptions().uses_int8_kernel
    assert _calls(CpuCompileOptions()) == 0
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert CpuCompileOptions().kernel_isa() == CpuCompileOptions(gemv_isa="avx512-bf16").kernel_isa() == "avx2"
    assert CpuCompileOptions().uses_int8_kernel and CpuCompileOptions().uses_kernel  # both have an AVX2 path
    with pytest.raises(ConfigError, match="gemv_isa"):
        CpuCompileOptions(gemv_isa="sse")


def test_forcing_the_isa_down_keeps_both_kernels_at_the_lower_level(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_cpu_flags",
                        lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "fma",
                                           "avx2", "avx_vnni"}))
    assert CpuCompileOptions().kernel_isa() == "avx512-bf16"
    for isa in ("avx512", "avx2-vnni", "avx2"):
        low = CpuCompileOptions(gemv_isa=isa)
        assert low.kernel_isa() == isa and low.uses_int8_kernel and low.uses_kernel


@needs_int8
def test_library_refused_on_a_cpu_without_its_isa(linears, monkeypatch, tmp_path):
    out, module, _, isa = linears
    cpu_gemv._loaded.clear()  # a library already loaded in this process is not checked again
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(ArtifactError, match=f"needs a CPU with .*{'avx512f' if isa.startswith('avx512') else 'avx2'}"):
        CpuBackend().load_graph(out, "lin", module)
