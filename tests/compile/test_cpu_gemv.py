"""The bf16 GEMV kernel (backends/cpu/cpu_gemv.cpp) against its PyTorch twin, inside real AOTInductor graphs.

The kernel and the reference both multiply the same bf16 values exactly (a product of two 8-bit significands fits
fp32) and accumulate in fp32, then round once to bf16; they differ only in summation order (fp32 reassociation,
~1e-6 relative), so after the bf16 rounding almost every output is bit-equal and the rest differ by one bf16 step
(2^-8 relative). Checked on 1-8 rows (the GEMV): at least 97% bit-equal and all within one step. On more rows (the
kernel's GEMM blocks; ATen's GEMM past 64 rows at the AVX512-BF16 level): within one bf16 step of the exact (fp64) product plus the
bound of an fp32 sum's error, K 2^-23 sum|x||w| (an output that nearly cancels can differ by more than a step of
itself). A kernel dropping the K tail, mixing rows or blocks, or misreading a stride fails both by far.
Every ISA level this CPU has is tested (AVX512-BF16, AVX-512 and AVX2 + FMA: the lower ones forced with gemv_isa; each
in its own process, see fresh_process.py),
rows 1..8, K with and without tails of the 16-element (AVX2), 32-element (AVX-512) and 32/64-element (AVX512-BF16)
blocks, odd N. The column groups (AVX2: 4 weight rows per pass up to 2 input rows, 2 up to 5; AVX-512: 4 up to 5, 3
up to 8; AVX512-BF16: 4, 3, 2, 5, 5, 4, 4, 3 for 1-8 rows) are covered with N a multiple of the group, N leaving
single columns, and N smaller than a group (single columns only), with and without K tails.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.ops import Ops
from tests.compile.fresh_process import run_check
from tests.compile.test_cpu_backend import T_CTX, S, empty_cache, row_table, tg_args, tiny_model

# the VNNI levels build the bf16 kernel as the level below (cpu_gemv.lowest_isa): the same code, tested once
ISAS = [isa for isa in cpu_gemv.ISAS if cpu_gemv.has_isa(isa) and isa not in ("avx512-vnni", "avx2-vnni")]
needs_kernel = pytest.mark.skipif(not cpu_gemv.supported(), reason="this CPU has no AVX2 + FMA")
# (R, N, K), rows 1..8. K: multiples of 64 (64, 576), 64 + 32 (96), tails of 4 (100), 8 (600, 200, 1544, 40), 1 (17,
# 33), 15 (31) and 5 (K < 16, no whole block), whole 16-blocks only (16, 48, 80); N odd in most, N = 1 once. AVX2
# column groups: N below the group (N = 1 at 3 rows, 3 at 2 rows); N mod group = 1, 2, 3 at 1-2 rows (257 and 33,
# 70, 7) and 1 at 3-5 rows (7, 9, 37). AVX-512 groups: N mod 4 = 1, 2, 3 and N < 4 at 3-5 rows (9, 130, 7, 1);
# N mod 3 = 0, 1, 2 and N < 3 at 6-8 rows (9, 31 and 4, 41, 2). AVX512-BF16 groups: N mod 4 = 1, 2, 3 at 1 row; 0
# at 2 rows; 1 and N < 2 at 3 rows; 0, 2, 4 and N < 5 at 4 rows (shared); 2, 3 at 5 rows; 1 and N < 4 at 6 rows;
# 0, 1 at 7 rows; 1, 2 at 8 rows.
# More rows: the GEMM's blocks (8 rows x 3 weight rows with AVX-512, 5 x 2 with AVX2): 9 (two blocks), 25, 17 with N
# leaving single columns, 64 (the most for the kernel's GEMM at the AVX512-BF16 level), 65 and 200 (ATen's GEMM there,
# the blocks below it), with K tails.
SHAPES = [(1, 70, 64), (2, 33, 96), (3, 1, 100), (4, 130, 600), (5, 48, 576), (6, 9, 1544), (7, 41, 5),
          (8, 65, 200), (8, 31, 17), (1, 257, 31), (2, 3, 48), (5, 37, 40), (3, 7, 33), (4, 9, 80), (1, 7, 16),
          (6, 2, 64), (7, 4, 48), (9, 70, 64), (25, 37, 600), (17, 131, 1544), (64, 33, 100), (65, 9, 200),
          (200, 41, 96)]


# Linears reading another shape's input (input index, N), which the export merges into shared kernel calls
# (backends/cpu/gemv_groups.py): five linears on input 3 (4 rows, K = 600) make a call of four matrices (the most per
# call) and one of one; three on input 0 make one call of three. So a graph makes len(SHAPES) + 1 calls.
SHARED = [(3, 9), (3, 130), (3, 1), (3, 7), (0, 33), (0, 5)]
SHARED_CALLS = 1  # calls the SHARED linears add: one on input 3 (its five linears make two calls), none on input 0


def sources(shapes) -> list[int]:
    """The input each linear reads: its own, then the SHARED ones'."""
    return list(range(len(shapes))) + [i for i, _ in SHARED]


def with_shared(shapes) -> list[tuple[int, int, int]]:
    """(R, N, K) of every linear: `shapes`, then the SHARED linears on their inputs."""
    return list(shapes) + [(shapes[i][0], n, shapes[i][2]) for i, n in SHARED]


class Linears(torch.nn.Module):
    """One bf16 linear per shape, each fed by its own [R, K] input (plus a bias on one, fused after the call), then
    the SHARED linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=i == 1)
                                        for i, (_, n, k) in enumerate(with_shared(SHAPES)))
        self.src = sources(SHAPES)
        self.ops = Ops(name="reference")  # the CPU backend traces with its table: kernel calls
        self.to(torch.bfloat16)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.ops.linear(lin, xs[i]) for lin, i in zip(self.lins, self.src))


def inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    return tuple(torch.randn(r, k).to(torch.bfloat16) for r, _, k in SHAPES)


def reference(module: Linears, xs) -> list[torch.Tensor]:
    out = []
    for lin, i in zip(module.lins, module.src):
        y = cpu_gemv.gemv_bf16(xs[i], [lin.weight])
        out.append(y if lin.bias is None else y + lin.bias)
    return out


@pytest.fixture(scope="module", params=ISAS)
def linears(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"gemv-{request.param}")
    module = Linears().eval()
    with torch.inference_mode():
        meta = CpuBackend(CpuCompileOptions(gemv_isa=request.param)).compile_graph(module, inputs(), out, "lin")
    return out, module, meta, request.param


def assert_one_rounding_apart(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    g, r = got.float(), ref.float()
    # one bf16 step at r: 2^(e - 8) for |r| in [2^(e-1), 2^e) (|r| * 2^-8 would be up to 2x less just below 2^e)
    step = torch.ldexp(torch.ones_like(r), torch.frexp(r.abs().clamp_min(1e-30)).exponent - 8)
    assert bool(((g - r).abs() <= step).all()), f"max diff {(g - r).abs().max().item()}"
    assert (g == r).float().mean().item() >= 0.97


def test_reference_is_fp32_accumulation_rounded_once():
    torch.manual_seed(2)
    x, w = torch.randn(3, 100).to(torch.bfloat16), torch.randn(20, 100).to(torch.bfloat16)
    exact = (x.double() @ w.double().t()).to(torch.bfloat16)  # fp64 sum, one rounding
    assert_one_rounding_apart(cpu_gemv.gemv_bf16(x, [w]), exact)


def assert_within_fp32_sums(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                            roundings: int = 1) -> None:
    """got [R, N] against x @ w^T (+ bias) summed exactly (fp64): within `roundings` bf16 steps (a bias added in
    bf16 is one more) plus an fp32 sum's error bound, K 2^-23 sum_k |x_k| |w_k|."""
    exact, scale = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()  # [R, N] each
    if bias is not None:
        exact, roundings = exact + bias.double(), roundings + 1
    step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1e-30)).exponent - 8)
    bound = roundings * step + x.shape[-1] * 2.0**-23 * scale
    assert bool(((got.double() - exact).abs() <= bound).all()), f"max diff {(got.double() - exact).abs().max()}"


def check_graph(out: str, isa: str) -> None:
    """The compiled graph against the reference on every shape (run in a fresh process: fresh_process.py)."""
    module = Linears().eval()
    assert json.loads((Path(out) / "lin.json").read_text())["gemv_kernel"]["isa"] == isa
    graph = CpuBackend().load_graph(Path(out), "lin", module)
    xs = inputs()
    with torch.inference_mode():
        got = graph(*xs)
        ref = reference(module, xs)
    for g, r, lin, i in zip(got, ref, module.lins, module.src):
        if xs[i].shape[0] <= cpu_gemv.MAX_ROWS:
            assert_one_rounding_apart(g, r)
        else:
            assert_within_fp32_sums(g, xs[i], lin.weight, lin.bias)


@needs_kernel
def test_compiled_kernel_equals_reference_on_every_shape(linears):
    out, _, meta, isa = linears
    assert meta["gemv_kernel"] and "lin.gemv.so" in meta["files"]
    run_check("tests.compile.test_cpu_gemv", "check_graph", str(out), isa)


@needs_kernel
def test_graph_calls_the_c_function_not_the_dispatcher(linears):
    out = linears[0]
    with zipfile.ZipFile(out / "lin.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_ni_gemv_bf16_v8(") >= len(SHAPES) + SHARED_CALLS
    assert "proxy_executor_call_function" not in wrapper  # the boxed-dispatcher route AOTI takes otherwise


def gemm_max_rows(isa: str) -> float:
    """The most rows a bf16 or int8 kernel call at this level computes in the kernel's own blocks (kGemmMaxRows):
    64 at AVX512-BF16 (ATen's GEMM beyond), every count below it (there ATen's bf16 GEMM is several times slower)."""
    return 64 if isa == "avx512-bf16" else math.inf


def blocks_rows(isa: str) -> int:
    """A prompt the blocks take whole at this level: 64 rows at AVX512-BF16, 200 below it."""
    return int(min(gemm_max_rows(isa), 200))


class RowsApart(torch.nn.Module):
    """One bf16 linear on a prompt-sized input [R, 4104] and on 8 of its rows alone (a GEMV call). Sums that long
    over 1000 outputs: another summation order (ATen's GEMM) changes the bf16 rounding of some of them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(4104, 1000, bias=False).to(torch.bfloat16)
        self.ops = Ops(name="reference")

    def forward(self, x: torch.Tensor, few: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.linear(self.lin, x), self.ops.linear(self.lin, few)


def rows_apart_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)
    x = torch.randn(rows, 4104).to(torch.bfloat16)
    return x, x[rows - 12:rows - 4].clone()  # 8 rows from the last block of the prompt


def check_rows_apart(out: str, isa: str) -> None:
    """Wherever the blocks take a call, a row's result does not depend on the call's other rows: the prompt's rows
    equal the same rows through the GEMV bit for bit (ATen's GEMM sums in another order)."""
    rows, module = blocks_rows(isa), RowsApart().eval()
    graph = CpuBackend().load_graph(Path(out), "apart", module)
    x, few = rows_apart_inputs(rows)
    with torch.inference_mode():
        big, small = graph(x, few)
    assert torch.equal(big[rows - 12:rows - 4], small)
    assert_within_fp32_sums(big, x, module.lin.weight, None)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_prompt_rows_equal_the_same_rows_alone(isa, tmp_path):
    module, xs = RowsApart().eval(), rows_apart_inputs(blocks_rows(isa))
    with torch.inference_mode():
        CpuBackend(CpuCompileOptions(gemv_isa=isa)).compile_graph(module, xs, tmp_path, "apart")
    run_check("tests.compile.test_cpu_gemv", "check_rows_apart", str(tmp_path), isa)


def step_args(k, v, tokens: int):
    """A step of `tokens` new tokens on both cache rows (1: decode; 4: a verify-like step, 8 rows per linear)."""
    if tokens == 1:
        return tg_args(k, v, 0)
    ids = torch.arange(7, 7 + 2 * tokens).view(2, tokens)  # [R, T]
    pos = torch.arange(T_CTX, T_CTX + tokens).repeat(2, 1)  # [R, T]
    return ids, pos, k, v, torch.arange(tokens).repeat(2, 1), row_table([0, 1], S)  # logits of every token: [R, T]


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 4])
def test_bf16_step_graph_is_as_accurate_as_eager_bf16(tmp_path, tokens):
    """A whole bf16 step (2 or 8 rows per linear) with the kernel, against the same bf16 weights computed in fp32.

    Criterion: the graph's logits are no further from that fp32 computation than eager bf16 (F.linear -> oneDNN)
    is, up to 1.5x (both round every activation to bf16 between ops); a kernel that drops a K tail, mixes rows or
    misreads a stride is off by O(1).
    """
    model = tiny_model().to(torch.bfloat16)
    exact = copy.deepcopy(model).float()  # the same (bf16-rounded) weights, fp32 arithmetic
    k, v = (t.to(torch.bfloat16) for t in empty_cache(model))
    with torch.inference_mode():
        meta = CpuBackend().compile_graph(BucketStep(model, S), step_args(k, v, tokens), tmp_path, "tg")
        graph = CpuBackend().load_graph(tmp_path, "tg", BucketStep(model, S))
        got = graph(*step_args(k.clone(), v.clone(), tokens)).float()
        eager = BucketStep(model, S)(*step_args(k.clone(), v.clone(), tokens)).float()
        ref = BucketStep(exact, S)(*step_args(k.float(), v.float(), tokens))
    assert meta["gemv_kernel"]
    with zipfile.ZipFile(tmp_path / "tg.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_ni_gemv_bf16_v8(" in wrapper
    eager_err = (eager - ref).abs().max().item()
    assert 0 < eager_err < 0.1
    assert (got - ref).abs().max().item() <= 1.5 * eager_err
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _calls(options: CpuCompileOptions) -> int:
    program = cpu._export(Linears().eval(), inputs(), options)
    return sum(node.target is cpu_gemv.OPS["bf16"] for node in program.graph.nodes)


def test_options_route_every_row_count_to_the_kernel_at_every_isa_level(monkeypatch):
    assert _calls(CpuCompileOptions(gemv_kernel=False)) == 0
    assert _calls(CpuCompileOptions(gemv_max_rows=0)) == 0
    for flags in ({"avx2", "fma"}, {"avx512f", "avx512bw", "avx512vl", "fma", "avx2"}):
        monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert CpuCompileOptions().uses_kernel
        calls = len(SHAPES) + SHARED_CALLS  # any row count, whatever gemv_max_rows (> 0) says
        assert _calls(CpuCompileOptions()) == _calls(CpuCompileOptions(gemv_max_rows=2)) == calls
    with pytest.raises(ConfigError, match="gemv_kernel"):
        CpuCompileOptions(gemv_kernel=1)


def test_cpus_without_avx2_keep_the_reduction_and_the_gemm_and_their_values(monkeypatch):
    """No kernel: 1-5 rows are Inductor reductions, 6-8 rows the GEMM; the exported program still computes the
    linears (checked eagerly against the reference: fp32 sums rounded once, or oneDNN's bf16 GEMM with fp32
    accumulation; both within the module docstring's criterion)."""
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert not CpuCompileOptions().uses_kernel and cpu_gemv.cpu_isa() is None and not cpu_gemv.supported()
    module, xs = Linears().eval(), inputs()
    program = cpu._export(module, xs, CpuCompileOptions())
    assert not any(node.target is cpu_gemv.OPS["bf16"] for node in program.graph.nodes)
    gemms = sum(node.target is torch.ops.aten.linear.default for node in program.graph.nodes)
    assert gemms == sum(r > 5 for r, _, _ in with_shared(SHAPES))
    with torch.inference_mode():
        got = program.module()(*xs)
        ref = reference(module, xs)
    for g, r in zip(got, ref):
        assert_one_rounding_apart(g, r)


@needs_kernel
@pytest.mark.parametrize("damage", ["missing", "corrupt", "bad-entry"])
def test_damaged_kernel_library_is_a_clear_error(linears, tmp_path, damage):
    out = tmp_path / "graphs"
    shutil.copytree(linears[0], out)
    lib = out / "lin.gemv.so"
    if damage == "missing":
        lib.unlink()
    elif damage == "corrupt":
        lib.write_bytes(lib.read_bytes()[:1000])
    else:
        side = json.loads((out / "lin.json").read_text())
        (out / "lin.json").write_text(json.dumps({**side, "gemv_kernel": {"file": "../x.gemv.so", "sha256": "0"}}))
    match = {"missing": r"lin\.gemv\.so.*missing.*recompile", "corrupt": r"lin\.gemv\.so.*corrupt.*recompile",
             "bad-entry": r"lin\.json is not .*recompile"}[damage]
    with pytest.raises(ArtifactError, match=match):
        CpuBackend().load_graph(out, "lin", linears[1])


def test_kernel_refused_on_a_cpu_without_avx512_bf16(monkeypatch, tmp_path):
    lib = tmp_path / "x.gemv.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setattr(cpu_gemv, "_cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}))
    with pytest.raises(ArtifactError, match="avx512_bf16"):
        cpu_gemv.load(lib, hashlib.sha256(lib.read_bytes()).hexdigest())
