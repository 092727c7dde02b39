"""The attention kernel (backends/cpu/cpu_attention.cpp) against an fp64 twin, inside real AOTInductor graphs.

Numerics: scores, softmax and the weighted sum in fp32, one rounding to bf16. The fp64 twin computes the same
attention exactly and rounds once; the kernel's fp32 sums differ from it by a few fp32 roundings of the summed terms,
which are up to max|v| while an output can be much smaller (a weighted mean of values of both signs). So each output
is within one bf16 step of the twin's plus 2^-16 max|v| (the fp32 error of a sum of a few hundred such terms, with
margin), and almost all are bit-equal (>= 97%: the GEMV kernels' criterion). The reference reductions meet the same
bound. A kernel reading a wrong key, dropping a chunk's tail, mixing heads or rows is off by far more.

Batch invariance (the property speculative verification relies on): a query row's result is the same bits whether
it is computed alone, among 150 rows (three of the kernel's 64-row work blocks), in a batch of two, or over a longer
cache bucket - checked with
torch.equal. Both ISA paths are tested on CPUs that have them (AVX-512, and AVX2 forced with gemv_isa="avx2"), each in
its own process (fresh_process.py).
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
from neuron_infer.model.llama import BucketStep
from tests.compile.fresh_process import run_check
from tests.compile.test_cpu_backend import S, empty_cache, tg_args, tiny_model
from tests.paged import as_blocks

ISAS = [isa for isa in ("avx512", "avx2") if cpu_gemv.has_isa(isa)]
needs_kernel = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX-512 nor AVX2")

# (B, H, R, S, D, bs): decode (G = 3 rows), verify (21 rows), 64 rows (one work block), prefill (a 100-token prompt's
# 300 folded rows over 260 keys: five row blocks, three chunks, blocks of 26), head dims 32-256,
# buckets that are not multiples of the 16-key groups or the 128-key chunks, fewer keys than one group; cache blocks
# of the kernel's chunk size, smaller (a chunk spans several), larger than a chunk, of one position.
CASES = [(1, 3, 3, 640, 64, 128), (2, 3, 21, 300, 64, 25), (1, 2, 64, 129, 64, 43), (1, 3, 300, 260, 64, 26),
         (2, 1, 5, 37, 128, 1), (1, 4, 7, 200, 32, 8), (1, 1, 2, 9, 256, 3), (3, 2, 1, 260, 96, 260)]


def case_inputs(b, h, r, s, d, bs, seed):
    """q [B, H, R, D] (a transposed view: strides as the model's), k, v [B, H, S, D] bf16 and positions [B, R]:
    each row's own position, including -1 (sees no key), 0, the last key and past it, and chunk borders."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, r, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    pos = torch.randint(0, s, (b, r), generator=g)
    special = torch.tensor([-1, 0, s - 1, s + 3, 127, 128, 15, 16])
    n = min(r, len(special))
    pos[0, :n] = special[:n]
    return q, k, v, pos


def paged(q, k, v, pos, bs, seed=0):
    """The kernel's operands: q, the sequences k, v in shuffled cache blocks of bs positions, their table, pos."""
    return (q, *as_blocks(k, v, bs, seed), pos)


def inputs():
    return tuple(t for i, c in enumerate(CASES) for t in paged(*case_inputs(*c, seed=i), c[-1], seed=i))


def invariance_inputs():
    """A 150-row case (2 batch rows, 3 heads, 300 keys), then rows of it alone (from the first, second and third
    64-row work block), over a longer bucket (420 keys; the extra keys are never visible) and with the other batch
    row replaced."""
    q, k, v, pos = case_inputs(2, 3, 150, 300, 64, 100, seed=99)
    pos = pos.clamp(0, 299)
    g = torch.Generator().manual_seed(100)
    extra = [torch.randn(2, 3, 120, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    longer = torch.cat([k, extra[0]], 2), torch.cat([v, extra[1]], 2)
    other = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    rows = [(q[:, :, i:i + 1], k, v, pos[:, i:i + 1]) for i in (0, 70, 149)]
    return (q, k, v, pos), rows, (q, *longer, pos), (torch.cat([q[:1], other[1:]]), k, v, pos)


class Attend(torch.nn.Module):
    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(cpu_gemv.attention(*args[i:i + 5]) for i in range(0, len(args), 5))


def fp64_twin(q, k, v, pos):
    """Exact attention rounded once to bf16; rows that see no key are zeros."""
    visible = torch.arange(k.shape[2]).view(1, 1, 1, -1) <= pos.unsqueeze(1).unsqueeze(-1)  # [B, 1, R, S]
    scores = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.double()
    return out.nan_to_num(0).to(torch.bfloat16)


def assert_one_rounding_apart(got: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> None:
    """Within one bf16 step of `ref` (at its magnitude) plus 2^-16 max|v|; >= 97% bit-equal (module docstring)."""
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    g, r = got.float(), ref.float()
    step = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - 7)  # one bf16 step at |r|
    err = (g - r).abs()
    assert bool((err <= step + 2.0**-16 * v.abs().max().float()).all()), f"max diff {err.max().item()}"
    assert (g == r).float().mean().item() >= 0.97


def flat(groups) -> tuple[torch.Tensor, ...]:
    """The kernel's operands of every group: the 300-key caches in blocks of 100, the 420-key ones in blocks of 60."""
    full, rows, longer, other = groups
    return (*paged(*full, 100), *(t for r in rows for t in paged(*r, 100)), *paged(*longer, 60, seed=1),
            *paged(*other, 100))


@pytest.fixture(scope="module", params=ISAS)
def graphs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"attn-{request.param}")
    backend = CpuBackend(CpuCompileOptions(gemv_isa=request.param))
    with torch.inference_mode():
        backend.compile_graph(Attend(), inputs(), out, "cases")
        backend.compile_graph(Attend(), flat(invariance_inputs()), out, "rows")
    return out, request.param


def check_graphs(out: str, isa: str) -> None:
    """Both graphs against the twin and each other (run in a fresh process: fresh_process.py)."""
    assert json.loads((Path(out) / "cases.json").read_text())["gemv_kernel"]["isa"] == isa
    cases = CpuBackend().load_graph(Path(out), "cases", Attend())
    rows = CpuBackend().load_graph(Path(out), "rows", Attend())
    with torch.inference_mode():
        got = cases(*inputs())
        for i, c in enumerate(CASES):
            q, k, v, pos = case_inputs(*c, seed=i)
            assert_one_rounding_apart(got[i], fp64_twin(q, k, v, pos), v)
            assert pos[0, 0] == -1 and not got[i][0, :, 0].any()  # a row that sees no key: zeros
        full, *alone, longer, other = rows(*flat(invariance_inputs()))
        bad = list(inputs())
        bad[3] = bad[3].clone()
        bad[3][0, -1] = bad[1].shape[0]  # a table entry past the cache's blocks: the kernel refuses, reads nothing
        with pytest.raises(RuntimeError):
            cases(*bad)
    full_inputs = invariance_inputs()[0]
    assert_one_rounding_apart(full, fp64_twin(*full_inputs), full_inputs[2])
    for i, one in zip((0, 70, 149), alone):
        assert torch.equal(one, full[:, :, i:i + 1])
    assert torch.equal(longer, full)
    assert torch.equal(other[0], full[0])


@needs_kernel
def test_compiled_kernel_equals_fp64_twin_and_is_batch_invariant(graphs):
    out, isa = graphs
    run_check("tests.compile.test_cpu_attention", "check_graphs", str(out), isa)


@needs_kernel
def test_graph_calls_the_c_function_not_the_dispatcher(graphs):
    with zipfile.ZipFile(graphs[0] / "cases.pt2") as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_ni_attn_v2(") >= len(CASES)
    assert "proxy_executor_call_function" not in wrapper


def test_reference_op_is_the_model_reductions_with_zeros_for_rows_without_keys():
    q, k, v, pos = case_inputs(2, 3, 21, 300, 64, 30, seed=5)
    out = cpu_gemv.attention(*paged(q, k, v, pos, 30))
    assert_one_rounding_apart(out, fp64_twin(q, k, v, pos), v)
    assert not out[0, :, 0].any()  # pos[0, 0] = -1


def _attention_calls(model: torch.nn.Module, options: CpuCompileOptions, tokens: int = 1,
                     dynamic_tokens: bool = False) -> int:
    """Kernel calls in the exported step of `tokens` tokens (dynamic_tokens: the token count a dimension of the
    graph, 2..S, as in a shape-class prefill graph)."""
    k, v = (t.to(next(model.parameters()).dtype) for t in empty_cache(model))
    ids, pos, *_, idx, table = tg_args(k, v, 0)
    args = (ids.expand(-1, tokens), pos + torch.arange(tokens), k, v, idx, table)
    dynamic = {0: {1: ("tokens", 2, S)}, 1: {1: ("tokens", 2, S)}} if dynamic_tokens else None
    program = cpu._export(BucketStep(model, S), args, options, dynamic)
    return sum(node.target is cpu_gemv.KERNEL_OPS["attn"] for node in program.graph.nodes)


def test_model_attention_calls_the_kernel_only_where_it_applies():
    """bf16 decode, verify and prefill steps of a model whose head dim the kernel takes call it once per layer (at
    any row count); fp32 models, head dims it does not take and gemv_kernel=False keep the reference."""
    bf16 = tiny_model(head_dim=32).to(torch.bfloat16)
    if not ISAS:
        assert _attention_calls(bf16, CpuCompileOptions()) == 0
        return
    layers = bf16.cfg.num_layers
    assert _attention_calls(bf16, CpuCompileOptions()) == layers
    assert _attention_calls(bf16, CpuCompileOptions(), tokens=8) == layers
    assert _attention_calls(bf16, CpuCompileOptions(), tokens=33) == layers  # G = 2: 66 rows, two work blocks
    assert _attention_calls(bf16, CpuCompileOptions(), tokens=5, dynamic_tokens=True) == layers  # any prompt length
    assert _attention_calls(bf16, CpuCompileOptions(gemv_kernel=False)) == 0
    assert _attention_calls(tiny_model(head_dim=32), CpuCompileOptions()) == 0  # fp32
    assert _attention_calls(tiny_model().to(torch.bfloat16), CpuCompileOptions()) == 0  # head dim 24
