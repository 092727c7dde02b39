"""kernels="nki" on the neuron target (model/nki_neuron.py) through recording doubles of the Neuron SDK.

The `nki` double (tests/compile/neuron_doubles.py) records each `nki.jit` wrap and `jitted[grid](...)` launch and
puts one opaque custom op per launch into the traced graph, whose implementation runs the kernel on our simulator;
the torch-neuronx double traces with `torch.jit.trace`. So these tests check the wiring (which kernels, which
shapes, grid, torch tensors only, weights as graph inputs) *and* its numbers. Not yet run on hardware.

Tolerances: fp32 everywhere, so kernel vs PyTorch reference differ by summation order only: 2e-5 absolute per op
on O(1) values, and 2e-4 on logits after 2 layers + LM head (as tests/kernels/test_nki_ops.py, measured ~2e-6;
a layout or head-map bug moves logits by > 1e-2). bf16/FP8 MLPs: conftest.TOL["bf16"] (tests/kernels).
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from neuron_infer.api import CompiledModel
from neuron_infer.artifact.weights import build_float_model
from neuron_infer.backends.neuron.graph import FunctionalStep
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.errors import BackendUnavailableError
from neuron_infer.model import nki_neuron, nki_ops
from neuron_infer.model.llama import BucketStep
from neuron_infer.model.ops import mlp_ref, sequence_attention
from neuron_infer.quant.fp8 import FP8Linear
from neuron_infer.quant.tiled import TiledLinear
from tests.compile.neuron_doubles import RUNS, RecordingNeuronSDK, RecordingNKI
from tests.paged import as_blocks

BUILD = BuildConfig(target="neuron", dtype="fp32", kernels="nki", max_context_length=32, max_length=64,
                    context_buckets=(16, 32), tokengen_buckets=(64,))


@pytest.fixture
def nki_double(monkeypatch):
    fake = RecordingNKI()
    monkeypatch.setattr(nki_neuron, "import_device_nki", lambda: fake)
    return fake


ONE_BLOCK = torch.zeros(1, 1, dtype=torch.int64)  # table [1, 1]: a cache of one block holds the row


@pytest.fixture(autouse=True)
def neuron_env(monkeypatch):
    """Both variables unset for the test and restored after it (loading sets NEURON_LOGICAL_NC_CONFIG)."""
    for name in (LNC_ENV, PLATFORM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_without_the_sdk_the_first_launch_says_how_to_install():
    q = torch.randn(1, 2, 4, 8)
    with nki_neuron.neuron_target(lnc=1), pytest.raises(BackendUnavailableError, match="Neuron pip repository"):
        nki_ops.attention(q, q[:, :1], q[:, :1], ONE_BLOCK, torch.tensor([0, 0]), torch.arange(4).view(1, 4))


def test_the_launch_grid_is_the_degree_the_trace_is_compiled_for():
    with pytest.raises(BackendUnavailableError, match="1 or 2"), nki_neuron.neuron_target(lnc=3):
        pass
    with pytest.raises(TypeError), nki_neuron.neuron_target():   # no default: the caller passes the compiled LNC
        pass


def test_outside_a_neuron_trace_the_ops_still_use_the_simulator(nki_double):
    q = torch.randn(1, 2, 4, 8)
    nki_ops.attention(q, q[:, :1], q[:, :1], ONE_BLOCK, torch.tensor([0, 0]), torch.arange(4).view(1, 4))
    assert nki_double.launches == []


@pytest.mark.parametrize("lnc", [1, 2])
def test_attention_launches_prefill_or_decode_with_the_lnc_grid(nki_double, lnc):
    gen = torch.Generator().manual_seed(0)
    q_to_kv = torch.tensor([0, 0, 0, 1, 1, 1])
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (6, 2, 2))       # T == S == 16: prefill
    qd = torch.randn(2, 6, 3, 8, generator=gen)                                    # 3 tokens vs S = 16: decode
    pos_p, pos_d = torch.arange(16).expand(2, 16), torch.tensor([[4, 5, 6], [13, 14, 15]])
    kc, vc, table = as_blocks(k, v, 8)  # the cache as the model holds it: shuffled blocks
    with nki_neuron.neuron_target(lnc=lnc):
        out_p = nki_ops.attention(q, kc, vc, table, q_to_kv, pos_p)
        out_d = nki_ops.attention(qd, kc, vc, table, q_to_kv, pos_d)
    torch.testing.assert_close(out_p, sequence_attention(q, k, v, q_to_kv, pos_p), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_d, sequence_attention(qd, k, v, q_to_kv, pos_d), atol=2e-5, rtol=2e-5)
    prefill, decode = nki_double.launches
    assert (prefill.kernel, prefill.grid, prefill.shapes) == (
        "flash_attention_prefill", lnc, ((2, 6, 8, 16), (2, 2, 8, 16), (2, 2, 16, 8)))
    assert prefill.statics == ((0, 0, 0, 1, 1, 1), 1.0 / 8 ** 0.5)
    assert (decode.kernel, decode.grid, decode.shapes) == (
        "attention_decode", lnc, ((2, 6, 8, 3), (2, 2, 8, 16), (2, 2, 16, 8), (2, 3)))
    assert nki_double.wrapped == ["flash_attention_prefill", "attention_decode"]


def _linears(gen, hidden, inter):
    mods = tuple(nn.Linear(a, b, bias=False) for a, b in ((hidden, inter), (hidden, inter), (inter, hidden)))
    with torch.no_grad():
        for m in mods:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.in_features ** 0.5)
    return mods


@pytest.mark.parametrize("kind", ["float", "fp8", "tiled_fp8"])
def test_mlp_launches_the_fused_kernel_with_weights_relaid_in_torch(nki_double, kind):
    from tests.kernels.conftest import check

    gen = torch.Generator().manual_seed(1)
    mods = _linears(gen, 160, 200)
    if kind != "float":
        mods = tuple(FP8Linear.from_linear(m.to(torch.bfloat16)) for m in mods)
    if kind == "tiled_fp8":
        mods = tuple(TiledLinear.from_module(m) for m in mods)
    x = torch.randn(2, 3, 160, generator=gen).to(torch.float32 if kind == "float" else torch.bfloat16)
    with torch.no_grad(), nki_neuron.neuron_target(lnc=1):
        out = nki_ops.mlp(x, *mods)
    ref = mlp_ref(x, *mods)
    (launch,) = nki_double.launches
    if kind == "float":
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        assert launch.kernel == "mlp_kernel"
        assert launch.shapes == ((6, 160), (128, 2, 2, 128), (128, 2, 2, 128), (128, 2, 2, 128))
    else:
        check(out.float().numpy(), ref.double().numpy(), "bf16")
        assert launch.kernel == "mlp_fp8_kernel" and launch.dtypes[1] == torch.float8_e4m3fn
        assert launch.shapes[4:] == ((128, 2), (128, 2), (128, 2))      # packed per-channel scales


def _tiny(tiny_dirs, kernels):
    model_dir = tiny_dirs("gqa")
    cfg = ModelConfig.from_model_dir(model_dir)
    build = BuildConfig(dtype="fp32", kernels=kernels)
    return cfg, build_float_model(cfg, build, load_checkpoint(model_dir, cfg))


def test_a_traced_tiny_llama_runs_the_kernels_as_graph_ops_and_matches_the_reference(nki_double, tiny_dirs):
    cfg, model = _tiny(tiny_dirs, "nki")
    _, ref = _tiny(tiny_dirs, "reference")
    t, s = 16, 16
    ids = (torch.arange(t).view(1, t) * 7 + 3) % cfg.vocab_size
    pos, idx = torch.arange(t).view(1, t), torch.tensor([[t - 1]])
    cache = (cfg.num_layers, 1, cfg.num_kv_heads, s, cfg.head_dim)
    sdk = RecordingNeuronSDK()
    with torch.no_grad():
        step = BucketStep(model, s)
        weights = {f"step.{k}": v.clone() for k, v in step.state_dict().items()}   # trace poisons the params
        table = torch.zeros(1, 1, dtype=torch.int64)  # [1, 1]: one block of s slots
        graph = sdk.trace(FunctionalStep(step, 1), (ids, pos, torch.zeros(cache), torch.zeros(cache), idx, table))
        sdk.replace_weights(graph, weights)
        logits, k_new, _ = graph(ids, pos, torch.zeros(cache), torch.zeros(cache), idx, table)
        k_ref, v_ref = torch.zeros(cache), torch.zeros(cache)
        want = BucketStep(ref, s)(ids, pos, k_ref, v_ref, idx, table)
    assert (logits - want).abs().max().item() < 2e-4
    torch.testing.assert_close(k_new, k_ref)
    kernels = [launch.kernel for launch in nki_double.launches]
    assert kernels == ["flash_attention_prefill", "mlp_kernel"] * cfg.num_layers    # traced once per layer
    assert "nki_double::launch" in str(graph.inlined_graph)                        # kernels are graph ops


def test_compile_and_generate_for_neuron_with_nki_kernels_equals_the_cpu_reference(nki_double, tiny_dirs,
                                                                                    tmp_path, monkeypatch):
    sdk = RecordingNeuronSDK()
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "neuron", BUILD, say=lambda m: None)
    compile_model(d, tmp_path / "eager", BUILD.replace(target="cpu", kernels="reference"), backend="cpu-eager",
                  say=lambda m: None)
    traces = [c for name, c in sdk.calls if name == "trace"]
    assert traces and all(t["args"][-1] == "--lnc=2" for t in traces)     # trn2's default LNC ...
    assert all(t["platform_env"] == "trn2" for t in traces)                # ... for the trn2 kernels
    by_kernel = {}
    for launch in nki_double.launches:
        by_kernel.setdefault(launch.kernel, set()).add((launch.grid, launch.shapes[0]))
    assert by_kernel == {"flash_attention_prefill": {(2, (1, 4, 24, 16)), (2, (1, 4, 24, 32))},   # grid == --lnc
                         "mlp_kernel": {(2, (16, 96)), (2, (32, 96)), (2, (1, 96))},
                         "attention_decode": {(2, (1, 4, 24, 1)), (2, (1, 4, 24, 16))}}  # 16 after a cached prefix
    prompt = [list(range(5, 25))]
    runs = len(RUNS)
    got = CompiledModel.load(tmp_path / "neuron").generate_ids(prompt, 12, ignore_eos=True)
    assert len(RUNS) - runs >= 2 * 2 * 12         # the loaded graphs ran the kernels (2 layers x 2 kernels/step)
    want = CompiledModel.load(tmp_path / "eager").generate_ids(prompt, 12, ignore_eos=True)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_neuron_tensor_parallel_with_nki_kernels_equals_the_cpu_reference(nki_double, tiny_dirs, tmp_path,
                                                                         monkeypatch):
    """tp = 2 through the neuronx-distributed double (ranks as threads; each rank's step launches the kernels)."""
    from tests.parallel.nxd_double import install
    from tests.parallel.test_tp_e2e import BUILD as TP_BUILD

    nxd, _ = install(monkeypatch, 2)
    d = tiny_dirs("gqa")
    compile_model(d, tmp_path / "n", TP_BUILD.replace(target="neuron", tp_degree=2, kernels="nki"),
                  say=lambda m: None)
    adds = [c for name, c in nxd.calls if name == "ModelBuilder.add"]
    assert adds and all(a["compiler_args"].endswith("--lnc=2") for a in adds)
    compile_model(d, tmp_path / "ref", TP_BUILD, backend="cpu-eager", say=lambda m: None)
    ids = [[1, 17, 42, 99, 7]]
    want = CompiledModel.load(tmp_path / "ref").generate_ids(ids, 8, ignore_eos=True).outputs[0].token_ids
    got = CompiledModel.load(tmp_path / "n").generate_ids(ids, 8, ignore_eos=True).outputs[0].token_ids
    assert got == want
    launched = {launch.kernel for launch in nki_double.launches}
    assert {launch.grid for launch in nki_double.launches} == {2}
    assert launched == {"flash_attention_prefill", "attention_decode", "mlp_kernel"}
    assert {launch.shapes[0][1] for launch in nki_double.launches if launch.kernel == "mlp_kernel"} == {96}
