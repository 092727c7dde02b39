"""The looped layer stack: loaded weights lie stacked per layer suffix, and CPU graphs run the layers as one while_loop.

* Layout: read_packed (artifact/weights.py) places layer i's `model.layers.{i}.<suffix>` right after layer i-1's, in a
  storage of its own per suffix, so LlamaModel.stack_layers exposes [L, ...] views of the loaded tensors (checked by
  pointer arithmetic: no copy).
* Fallback: layers not stacked in memory (a model built in place) or not uniform (one layer quantized differently)
  are traced unrolled.
* Values: the looped graphs (prefill with its dynamic token count, decode) equal eager and the unrolled graph; a bf16
  decode with the C kernels (bf16, int8, w8a8 linears and attention) inside the loop body equals eager (BF16_TOL).
  Tolerance: fp32 logits and caches within 1e-4 absolute (the module docstring of test_cpu_backend.py: float
  reassociation only; the loop runs the same per-layer code).
"""
from __future__ import annotations

import pytest
import torch

from neuron_infer.artifact.plan import IDS, LOGIT_INDEX, POSITIONS, TABLE, TOKENS
from neuron_infer.artifact.weights import assign_state, pack_state, read_packed, save_rank_weights
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions, _export
from neuron_infer.config import QuantConfig
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.quant import apply_quantization
from tests.compile.test_cpu_backend import ATOL, BS, empty_cache, tiny_model

LAYERS = 3
needs_kernel = pytest.mark.skipif(not cpu_gemv.supported(), reason="this CPU has no AVX2 + FMA")
# bf16 graphs vs the eager bf16 model: every op rounds to bf16 (2^-8 relative) in both, the kernels and the GEMMs sum
# in other orders, so logits differ by a few bf16 steps of their largest value after 3 layers (measured: 0.0086 of the
# largest logit for bf16, 0.0077 for int8, 0 for w8a8, whose kernel reproduces its reference bit for bit)
BF16_TOL = 2**-5
ATTEND = 32  # positions the example step attends (4 blocks of BS)


def restacked(model: LlamaModel) -> LlamaModel:
    """`model` with its tensors laid out as the runtime loads them (read_packed): decoder layers stacked."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.lm_head.weight is model.model.embed_tokens.weight:
        state.pop("lm_head.weight")  # re-tied by assign_state
    assign_state(model, pack_state(state), "test weights")
    return model


def _while_loops(program) -> int:
    return sum(n.target is torch.ops.higher_order.while_loop for n in program.graph.nodes)


def test_loaded_layer_tensors_are_views_of_one_block_per_suffix(tmp_path):
    model = tiny_model(num_layers=LAYERS)
    save_rank_weights(model, tmp_path / "w.safetensors")
    packed = read_packed(tmp_path / "w.safetensors")
    for suffix in ("mlp.up_proj.weight", "self_attn.q_proj.bias", "input_layernorm.weight"):
        ts = [packed[f"model.layers.{i}.{suffix}"] for i in range(LAYERS)]
        nbytes = ts[0].numel() * ts[0].element_size()
        assert all(t.untyped_storage().data_ptr() == ts[0].untyped_storage().data_ptr() for t in ts)
        assert [t.data_ptr() - ts[0].data_ptr() for t in ts] == [i * nbytes for i in range(LAYERS)]
        assert all(torch.equal(t, model.state_dict()[f"model.layers.{i}.{suffix}"]) for i, t in enumerate(ts))
    # each run of tensors is a storage of its own (a while_loop's inputs must not alias each other)
    up, down = packed["model.layers.0.mlp.up_proj.weight"], packed["model.layers.0.mlp.down_proj.weight"]
    assert up.untyped_storage().data_ptr() != down.untyped_storage().data_ptr()


def test_stacked_views_share_the_loaded_memory():
    model = restacked(tiny_model(num_layers=LAYERS))
    assert model.stack_layers()
    stack = model.layer_stack.mlp__gate_proj__weight  # [L, I, H]
    layers = [layer.mlp.gate_proj.weight for layer in model.model.layers]
    assert stack.shape == (LAYERS, *layers[0].shape) and stack.is_contiguous()
    assert stack.data_ptr() == layers[0].data_ptr()  # a view, no copy
    assert stack.untyped_storage().data_ptr() == layers[0].untyped_storage().data_ptr()
    assert all(stack[i].data_ptr() == w.data_ptr() and torch.equal(stack[i], w) for i, w in enumerate(layers))
    assert "layer_stack.mlp__gate_proj__weight" not in model.state_dict()  # never saved: non-persistent


def test_layers_not_stacked_in_memory_or_not_uniform_run_unrolled():
    step_args = _decode_args(tiny_model(num_layers=LAYERS))
    plain = tiny_model(num_layers=LAYERS)  # tensors allocated one by one
    assert not plain.stack_layers()
    mixed = tiny_model(num_layers=LAYERS)
    apply_quantization(mixed, QuantConfig(scheme="int8", modules_to_not_convert=["model.layers.0.mlp"]))
    mixed = restacked(mixed)
    assert not mixed.stack_layers()  # layer 0's MLP is float, the others int8
    looped = restacked(tiny_model(num_layers=LAYERS))
    with torch.inference_mode():
        counts = [_while_loops(_export(BucketStep(m, ATTEND), step_args, CpuCompileOptions()))
                  for m in (plain, mixed, looped)]
    assert counts == [0, 0, 1]


def _decode_args(model: LlamaModel) -> tuple:
    k, v = empty_cache(model)
    table = torch.tensor([[1, 2, 3, 4]])  # [1, ATTEND/BS]
    return torch.tensor([[7]]), torch.tensor([[9]]), k, v, torch.zeros(1, 1, dtype=torch.int64), table


def _prefill_args(model: LlamaModel, t: int) -> tuple:
    k, v = empty_cache(model)
    ids = (torch.arange(t) * 37 % 320).view(1, t)  # [1, T]
    return ids, torch.arange(t).view(1, t), k, v, torch.tensor([[t - 2, t - 1]]), torch.tensor([[1, 2, 3, 4]])


PREFILL_DYNAMIC = {IDS: {1: (TOKENS, 2, ATTEND)}, POSITIONS: {1: (TOKENS, 2, ATTEND)},
                   LOGIT_INDEX: {1: ("rows", 2, ATTEND)}, TABLE: {1: ("blocks", 2, ATTEND // BS)}}


def test_looped_graphs_equal_eager_and_the_unrolled_graph(tmp_path):
    """A prefill graph traced at 5 tokens runs 7 and 13 (its dynamic token count survives the loop body), a
    decode graph runs the next token; logits and the caches written equal eager's and the unrolled graph's."""
    looped, plain = restacked(tiny_model(num_layers=LAYERS)), tiny_model(num_layers=LAYERS)
    be = CpuBackend()
    with torch.inference_mode():
        for name, model in (("looped", looped), ("unrolled", plain)):
            be.compile_graph(BucketStep(model, ATTEND), _prefill_args(model, 5), tmp_path, name,
                             dynamic=PREFILL_DYNAMIC)
        be.compile_graph(BucketStep(looped, ATTEND), _decode_args(looped), tmp_path, "decode")
    sidecar = (tmp_path / "looped.json").read_text()
    assert "layer_stack" in sidecar and "model.layers.1." not in sidecar  # binds the stacked views only
    graphs = {n: be.load_graph(tmp_path, n, BucketStep(looped, ATTEND)) for n in ("looped", "unrolled", "decode")}
    for t in (7, 13):
        with torch.inference_mode():
            runs = {n: _run(graphs[n], graphs["decode"], looped, t) for n in ("looped", "unrolled")}
            runs["eager"] = _run(BucketStep(plain, ATTEND), BucketStep(plain, ATTEND), plain, t)
        got = runs["looped"]
        assert got[2].abs().sum() > 0  # the graph wrote the caller's cache
        for ref in (runs["eager"], runs["unrolled"]):
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, atol=ATOL, rtol=0)


def _run(prefill, decode, model: LlamaModel, t: int) -> tuple:
    """A t-token prompt, then one decode step -> (prompt logits, next-token logits, k cache, v cache)."""
    ids, pos, k, v, idx, table = _prefill_args(model, t)
    first = prefill(ids, pos, k, v, idx, table)
    nxt = decode(torch.tensor([[11]]), torch.tensor([[t]]), k, v, torch.zeros(1, 1, dtype=torch.int64), table)
    return first, nxt, k, v


@needs_kernel
@pytest.mark.parametrize("scheme", ["bf16", "int8", "w8a8"])
def test_looped_decode_with_c_kernels_equals_eager(tmp_path, scheme):
    """bf16 decode, its linears (bf16, int8 or w8a8) and attention through the C kernels inside the loop body: the
    body holds the kernel calls (q/k/v and gate/up merged) and the logits equal the eager model's (the reference
    ops: GEMMs and fp32 reductions) within BF16_TOL."""
    model = tiny_model(num_layers=LAYERS, head_dim=32).to(torch.bfloat16)  # a head dim the attention kernel takes
    if scheme != "bf16":
        apply_quantization(model, QuantConfig(scheme=scheme))
    model = restacked(model)
    k, v = (c.to(torch.bfloat16) for c in empty_cache(model))
    args = _decode_args(model)[:2] + (k, v) + _decode_args(model)[4:]
    step = BucketStep(model, ATTEND)
    with torch.inference_mode():
        program = _export(step, args, CpuCompileOptions())
        body = [n.target for gm in program.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
                and gm is not program.graph_module for n in gm.graph.nodes]
        linear_op = cpu_gemv.OPS["bf16" if scheme == "bf16" else scheme]
        assert _while_loops(program) == 1 and body.count(linear_op) == 4 and cpu_gemv.KERNEL_OPS["attn"] in body
        CpuBackend().compile_graph(step, args, tmp_path, "decode")
        graph = CpuBackend().load_graph(tmp_path, "decode", step)
        kg, vg, ke, ve = k.clone(), v.clone(), k.clone(), v.clone()
        got = graph(args[0], args[1], kg, vg, args[4], args[5]).float()
        want = step(args[0], args[1], ke, ve, args[4], args[5]).float()
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, atol=BF16_TOL * want.abs().max().item(), rtol=0)


@needs_kernel
def test_int8_prefill_runs_the_kernel_at_any_token_count(tmp_path):
    """An int8 bf16 prefill graph (its token count dynamic, traced at 5): the loop body calls the int8 kernel for
    every linear (q/k/v and gate/up merged), and at 3, 13 and 29 tokens (the kernel's GEMV, and its GEMM in blocks
    of rows past 8) the logits and the caches written equal the eager model's within BF16_TOL."""
    model = restacked(apply_quantization_to(tiny_model(num_layers=LAYERS, head_dim=32).to(torch.bfloat16), "int8"))
    step = BucketStep(model, ATTEND)

    def args(t: int) -> tuple:
        ids, pos, k, v, idx, table = _prefill_args(model, t)
        return ids, pos, k.to(torch.bfloat16), v.to(torch.bfloat16), idx, table

    with torch.inference_mode():
        program = _export(step, args(5), CpuCompileOptions(), dynamic=PREFILL_DYNAMIC)
        body = [n.target for gm in program.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
                and gm is not program.graph_module for n in gm.graph.nodes]
        assert _while_loops(program) == 1 and body.count(cpu_gemv.OPS["int8"]) == 4
        CpuBackend().compile_graph(step, args(5), tmp_path, "prefill", dynamic=PREFILL_DYNAMIC)
        graph = CpuBackend().load_graph(tmp_path, "prefill", step)
        for t in (3, 13, 29):
            ids, pos, k, v, idx, table = args(t)
            ke, ve = k.clone(), v.clone()
            got = graph(ids, pos, k, v, idx, table).float()
            want = step(ids, pos, ke, ve, idx, table).float()
            assert got.abs().max() > 0 and k.abs().sum() > 0
            torch.testing.assert_close(got, want, atol=BF16_TOL * want.abs().max().item(), rtol=0)
            for c, ce in ((k, ke), (v, ve)):
                torch.testing.assert_close(c.float(), ce.float(), atol=BF16_TOL * ce.abs().max().item(), rtol=0)


def apply_quantization_to(model: LlamaModel, scheme: str) -> LlamaModel:
    apply_quantization(model, QuantConfig(scheme=scheme))
    return model
