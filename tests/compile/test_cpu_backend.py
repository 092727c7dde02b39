"""CPU backend (torch.export + AOTInductor): compiled graphs equal eager, load in a fresh process, share weights.

One module-scoped compile of a tiny fp32 model (a context graph of one sequence and a token-generation graph over
two, both through block tables) serves
every test; it takes ~20-40 s on 2 cores. Tolerance: fp32 logits within 1e-4 absolute of eager. The compiled graph
sums in another order (Inductor's vectorised reductions, the op table's GEMVs for one-row linears), so results differ
by float reassociation only; logits here are O(1), where fp32 reassociation error is ~1e-6.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from neuron_infer.backends import get_backend
from neuron_infer.backends.cpu import ops as cpu_ops
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.config import ModelConfig
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.model.ops import rms_norm_ref

ATOL = 1e-4  # fp32, see module docstring
CFG = {"vocab_size": 320, "hidden_size": 96, "intermediate_size": 200, "num_layers": 2, "num_heads": 4,
       "num_kv_heads": 2, "head_dim": 24, "attention_bias": True}
ROWS, S, T_CTX = 2, 32, 8  # sequences, their length (tokengen bucket), context bucket
BS = 8  # KV-cache block size: row r holds blocks 1 + 4r .. 4 + 4r (block 0 is scratch)


def row_table(rows: list[int], attend: int) -> torch.Tensor:
    """[len(rows), attend/BS] the blocks of each row."""
    per = S // BS
    return torch.tensor([[1 + r * per + j for j in range(attend // BS)] for r in rows])


def tiny_model(seed: int = 0, **overrides) -> LlamaModel:
    """Seeded tiny fp32 model (random norms and biases too, so an ignored weight would show)."""
    torch.manual_seed(seed)
    model = LlamaModel(ModelConfig(**{**CFG, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def empty_cache(model: LlamaModel, blocks: int = 1 + ROWS * S // BS) -> tuple[torch.Tensor, torch.Tensor]:
    c = model.cfg
    shape = (c.num_layers, blocks, c.num_kv_heads, BS, c.head_dim)  # [L, N, Hkv, bs, D]
    return torch.zeros(shape), torch.zeros(shape)


def ctx_args(model, k, v, row=1):
    ids = torch.arange(3, 3 + T_CTX).view(1, T_CTX)  # [1, T]
    pos = torch.arange(T_CTX).view(1, T_CTX)  # [1, T]
    return ids, pos, k, v, torch.tensor([[T_CTX - 1]]), row_table([row], T_CTX)


def tg_args(k, v, step):
    ids = torch.tensor([[7 + step], [11 + step]])  # [R, 1]
    pos = torch.full((ROWS, 1), T_CTX + step)  # [R, 1]
    return ids, pos, k, v, torch.zeros(ROWS, 1, dtype=torch.int64), row_table(list(range(ROWS)), S)


def run_steps(ctx, tg, model):
    """Prefill row 1, then 3 decode steps over both rows; returns every output and the final caches."""
    k, v = empty_cache(model)
    outs = [ctx(*ctx_args(model, k, v))]
    for step in range(3):
        outs.append(tg(*tg_args(k, v, step)))
    return outs, k, v


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs")
    model = tiny_model()
    be = CpuBackend()
    k, v = empty_cache(model)
    meta = {}
    with torch.inference_mode():  # as the builder calls it
        meta["ctx"] = be.compile_graph(BucketStep(model, T_CTX), ctx_args(model, k, v), out, "ctx")
        meta["tg"] = be.compile_graph(BucketStep(model, S), tg_args(k, v, 0), out, "tg")
    return out, meta


def load_pair(be, out: Path, model: LlamaModel):
    return be.load_graph(out, "ctx", BucketStep(model, T_CTX)), be.load_graph(out, "tg", BucketStep(model, S))


def test_registry_returns_cpu_backend():
    assert isinstance(get_backend("cpu"), CpuBackend)


def test_cpu_linear_op_matches_the_module():
    """The CPU op table's linear without C kernels: GEMV reductions for float linears on at most 5 rows, the
    module's own forward beyond (fp32 reassociation only)."""
    torch.manual_seed(0)
    lin = cpu_ops.cpu_linear(max_rows=5, available=())
    for bias in (True, False):
        m = torch.nn.Linear(96, 70, bias=bias)
        # one row (GEMV), 2 and 4 rows (one reduction per row), 5 rows in a [5, 1] lead, six rows (the module)
        for shape in [(1, 1, 96), (2, 96), (2, 2, 96), (5, 1, 96), (2, 3, 96)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(lin(m, x), m(x), atol=1e-5, rtol=1e-5)  # fp32 reassociation


def test_few_row_gemv_compiles_to_the_same_values():
    """Inductor fuses the per-row reductions; the compiled form must still equal the definition (fp32)."""
    torch.manual_seed(1)
    w, x = torch.randn(70, 96), torch.randn(4, 1, 96)
    got = torch.compile(lambda x, w: cpu_ops.gemv_reductions(x, w, None, 4), fullgraph=True)(x, w)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def _gemv_loop_code(monkeypatch, barrier: bool) -> str:
    """Inductor's C++ for RMSNorm -> one-row GEMV [70, 96]: the text of the loop over the 70 output rows."""
    if not barrier:
        monkeypatch.setattr(cpu_ops, "computed_once", lambda t: t)
    torch.manual_seed(0)
    x, w, nw = torch.randn(1, 1, 96), torch.randn(70, 96), torch.randn(96)
    fn = torch.compile(lambda x, w, nw: cpu_ops.gemv_reductions(rms_norm_ref(x, nw, 1e-5), w, None, 1),
                       fullgraph=True)
    got, (code,) = run_and_get_code(fn, x, w, nw)
    torch.testing.assert_close(got, F.linear(rms_norm_ref(x, nw, 1e-5), w), atol=1e-5, rtol=1e-5)
    start = code.index("x0<static_cast<int64_t>(70L)")
    return code[start: code.index("}", code.index("out_ptr", code.index("tmp_acc0 = tmp_acc0 +", start)))]


def test_gemv_input_is_computed_once_not_per_output_row(monkeypatch):
    """The norm in front of a GEMV is computed into a buffer once; without the barrier Inductor recomputes it
    (its rsqrt included) inside the loop over the weight rows - the check below sees that difference."""
    assert "sqrt" not in _gemv_loop_code(monkeypatch, barrier=True)
    assert "sqrt" in _gemv_loop_code(monkeypatch, barrier=False)


def test_invalid_options():
    with pytest.raises(ConfigError, match="gemv_max_rows"):
        CpuCompileOptions(gemv_max_rows=-1)


def test_metadata_and_files(compiled):
    out, meta = compiled
    for name, m in meta.items():
        assert m["files"] == [f"{name}.pt2", f"{name}.json"]
        assert all((out / f).is_file() for f in m["files"])
        assert m["compile_seconds"] > 0 and m["package_bytes"] == (out / f"{name}.pt2").stat().st_size


def test_compiled_equals_eager_with_in_place_cache(compiled):
    out, _ = compiled
    model = tiny_model()
    ctx, tg = load_pair(CpuBackend(), out, model)
    with torch.inference_mode():
        got, kg, vg = run_steps(ctx, tg, model)
        ref, kr, vr = run_steps(BucketStep(model, T_CTX), BucketStep(model, S), model)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=ATOL, rtol=0)
    assert kg[:, 5].abs().sum() > 0  # the graphs wrote the caller's cache tensors (row 1's first block) ...
    torch.testing.assert_close(kg, kr, atol=ATOL, rtol=0)  # ... exactly where eager writes
    torch.testing.assert_close(vg, vr, atol=ATOL, rtol=0)


def test_one_graph_serves_a_cache_of_any_block_count(compiled):
    """The block count is a dynamic dimension: the graph compiled on 9 blocks runs a 23-block cache as eager does."""
    out, _ = compiled
    model = tiny_model()
    tg = CpuBackend().load_graph(out, "tg", BucketStep(model, S))
    k, v = empty_cache(model, blocks=23)
    table = torch.tensor([[22, 3, 17, 9], [5, 20, 1, 14]])  # [2, S/BS] anywhere in the bigger cache
    ids, pos, _, _, idx, _ = tg_args(k, v, 0)
    kr, vr = k.clone(), v.clone()
    with torch.inference_mode():
        got = tg(ids, pos, k, v, idx, table)
        want = BucketStep(model, S)(ids, pos, kr, vr, idx, table)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(k, kr, atol=ATOL, rtol=0)
    assert k[:, 3].abs().sum() > 0  # position T_CTX of row 0 is in its second block


def test_load_in_fresh_process(compiled, tmp_path):
    out, _ = compiled
    result = tmp_path / "out.pt"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cpu_backend import tiny_model, load_pair, run_steps
        from neuron_infer.backends.cpu.graph import CpuBackend
        torch.set_num_threads(2)
        model = tiny_model()
        ctx, tg = load_pair(CpuBackend(), __import__("pathlib").Path({str(out)!r}), model)
        with torch.inference_mode():
            outs, k, v = run_steps(ctx, tg, model)
        torch.save({{"outs": outs, "k": k}}, {str(result)!r})
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result)
    model = tiny_model()
    with torch.inference_mode():
        ref, kr, _ = run_steps(BucketStep(model, T_CTX), BucketStep(model, S), model)
    for g, r in zip(got["outs"], ref):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=0)
    torch.testing.assert_close(got["k"], kr, atol=ATOL, rtol=0)


def test_weights_live_outside_the_graph_files(compiled):
    """No weight bytes in any graph file; the loaded graph reads the module's own tensors (no copy)."""
    out, _ = compiled
    model = tiny_model()
    blobs = [zipfile.ZipFile(p).read(n) for p in out.glob("*.pt2") for n in zipfile.ZipFile(p).namelist()]
    for name in ("lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        needle = model.get_parameter(name).detach().flatten()[:16].numpy().tobytes()  # 64 bytes of random floats
        assert not any(needle in blob for blob in blobs), f"{name} is embedded in a graph file"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sizes = [p.stat().st_size for p in out.glob("*.pt2")]
    assert weight_bytes > 500_000 and max(sizes) < 8_000_000  # code only; sanity bounds for this tiny model
    tg = CpuBackend().load_graph(out, "tg", BucketStep(model, S))
    k, v = empty_cache(model)
    with torch.inference_mode():
        before = tg(*tg_args(k.clone(), v.clone(), 0))
        model.lm_head.weight.mul_(2.0)  # in place: a graph holding a copy would not see it
        after = tg(*tg_args(k.clone(), v.clone(), 0))
    torch.testing.assert_close(after, 2.0 * before, atol=ATOL, rtol=0)


def _copy(compiled, tmp_path) -> Path:
    dst = tmp_path / "graphs"
    shutil.copytree(compiled[0], dst)
    return dst


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_corrupted_graph_file_raises_artifact_error(compiled, tmp_path, damage):
    out = _copy(compiled, tmp_path)
    pkg = out / "tg.pt2"
    if damage == "garbage":
        pkg.write_bytes(b"not a graph" * 100)
    elif damage == "truncated":
        pkg.write_bytes(pkg.read_bytes()[: pkg.stat().st_size // 2])
    else:
        pkg.unlink()
    with pytest.raises(ArtifactError, match=r"tg\.pt2.*recompile"):
        CpuBackend().load_graph(out, "tg", BucketStep(tiny_model(), S))


def test_damaged_library_inside_package_raises_artifact_error(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    pkg = out / "tg.pt2"
    with zipfile.ZipFile(compiled[0] / "tg.pt2") as src, zipfile.ZipFile(pkg, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[: len(data) // 3] if item.filename.endswith(".so") else data)
    with pytest.raises(ArtifactError, match=r"tg\.pt2.*recompile"):
        CpuBackend().load_graph(out, "tg", BucketStep(tiny_model(), S))


def test_bad_sidecar_and_mismatching_weights(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    with pytest.raises(ArtifactError, match="intermediate|down_proj|gate_proj|up_proj"):
        CpuBackend().load_graph(out, "tg", BucketStep(tiny_model(intermediate_size=208), S))
    side = json.loads((out / "tg.json").read_text())
    (out / "tg.json").write_text(json.dumps({**side, "torch": "1.0.0"}))
    with pytest.raises(ArtifactError, match="torch 1.0.0"):
        CpuBackend().load_graph(out, "tg", BucketStep(tiny_model(), S))
    (out / "tg.json").write_text("{")
    with pytest.raises(ArtifactError, match="unreadable"):
        CpuBackend().load_graph(out, "tg", BucketStep(tiny_model(), S))


class _PlainTensorAttr(torch.nn.Module):
    """Uses a tensor that is not a parameter or buffer: the graph could not share it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.mix = torch.randn(8, 8)

    def forward(self, x):
        return self.lin(x) @ self.mix


def test_unshareable_tensor_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="register_buffer"):
        CpuBackend().compile_graph(_PlainTensorAttr(), (torch.randn(2, 8),), tmp_path, "g")


def test_graphs_compile_with_every_core_visible_and_the_thread_count_is_restored():
    """Inductor emits OpenMP loops only when the compiling process has > 1 thread: compile under all cores."""
    import os

    from neuron_infer.backends.cpu.graph import _all_cores

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _all_cores():
            assert torch.get_num_threads() == max(1, os.cpu_count() or 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
