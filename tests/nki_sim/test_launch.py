"""Entry points (nki.jit, kernel[lnc], nki.simulate, simulate_kernel), targets, torch I/O, recording, cost-only mode,
and the nki.language convenience wrappers (NKI documentation)."""
from __future__ import annotations

import time

import ml_dtypes
import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest
from nki.simulator import simulate_kernel

from nki_kernels.examples.gemm import gemm_kernel
from nki_kernels.sim import ListRecorder, ShapeSpec, SimulationError, recording

from .conftest import hbm_out, run, sbuf_in


def _ids_kernel(x_hbm):
    """Each program writes its id (and num_programs, program_ndim) into its half of the rows."""
    out = nl.ndarray(x_hbm.shape, nl.float32, buffer=nl.shared_hbm)
    n, pid = nl.num_programs(), nl.program_id(0)
    rows = x_hbm.shape[0] // n
    t = nl.ndarray((rows, 3), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t[:, 0:1], value=float(pid))
    nisa.memset(dst=t[:, 1:2], value=float(n))
    nisa.memset(dst=t[:, 2:3], value=float(nl.program_ndim()))
    nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows, :], src=t)
    return out


def test_jit_lnc2_runs_two_programs_over_shared_outputs(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    k = nki.jit(_ids_kernel)
    x = np.zeros((8, 3), np.float32)
    out = k[2](x)
    np.testing.assert_array_equal(out[:, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    assert (out[:, 1] == 2).all() and (out[:, 2] == 1).all()
    no_grid = k(x)                                   # no bracket: one program, program_ndim() == 0
    assert (no_grid[:, 1] == 1).all() and (no_grid[:, 2] == 0).all()
    np.testing.assert_array_equal(nki.simulate(k[2])(x), out)
    np.testing.assert_array_equal(simulate_kernel(_ids_kernel, (x,), {}, lnc=2), out)
    np.testing.assert_array_equal(nki.simulate(_ids_kernel)(x), no_grid)


def test_launch_errors():
    k = nki.jit(_ids_kernel)
    with pytest.raises(SimulationError, match="SPMD grids are legacy NKI"):
        k[2, 2]
    with pytest.raises(SimulationError, match="lnc must be 1 or 2"):
        k[3]
    with pytest.raises(SimulationError, match="LNC2 needs trn2/trn3"):
        run(_ids_kernel, np.zeros((8, 3), np.float32), lnc=2, target="trn1")
    with pytest.raises(SimulationError, match="platform_target"):
        nki.jit(_ids_kernel, platform_target="trn2")


@pytest.mark.parametrize("env,gen", [("trn1", 2), ("inf2", 2), ("gen3", 3), ("trn2", 3), ("trn3", 4), ("", 4)])
def test_target_from_environment(monkeypatch, env, gen):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", env)
    seen = {}

    def kernel():
        seen["v"] = nisa.get_nc_version()
        seen["sbuf"] = nl.tile_size.sbuf_fmax_bytes

    nki.simulate(kernel)()
    assert seen["v"] == nisa.nc_version(gen)
    assert seen["sbuf"] == {2: 180_224, 3: 212_984, 4: 245_752}[gen]


def test_unknown_target_raises(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(SimulationError, match="unknown NeuronCore target 'trn9'"):
        nki.simulate(lambda: None)()


def test_outputs_must_be_shared_hbm():
    def kernel():
        return nl.ndarray((4, 4), nl.float32, buffer=nl.hbm)

    with pytest.raises(SimulationError, match="must be allocated with buffer=nl.shared_hbm"):
        run(kernel)


def _inplace_kernel(x_hbm):
    t = sbuf_in(x_hbm)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=x_hbm, src=t)
    return hbm_out(t)


def test_numpy_inputs_are_updated_in_place_even_when_not_contiguous(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    ref = 2 * x
    run(_inplace_kernel, x)
    np.testing.assert_array_equal(x, ref)
    y = rng.standard_normal((6, 4)).astype(np.float32)
    y_ref = 2 * y
    run(_inplace_kernel, y.T)                 # non-contiguous view: copied in, written back through the view
    np.testing.assert_array_equal(y, y_ref)


def test_torch_tensors_in_and_out_including_bf16(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    before = x.clone()
    out = run(_inplace_kernel, x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, before * 2) and torch.equal(x, before * 2)   # doubling is exact in bf16
    f8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    out8 = run(lambda t: hbm_out(sbuf_in(t)), f8)
    assert out8.dtype == torch.float8_e4m3fn and torch.equal(out8.view(torch.uint8), f8.view(torch.uint8))


def test_unsupported_argument_dtype_raises():
    with pytest.raises(SimulationError, match="float64"):
        run(lambda x: None, np.zeros((4, 4)))


def test_recorder_and_recording_context_receive_one_event_per_instruction(rng):
    lhsT = rng.standard_normal((256, 128)).astype(np.float32)
    rhs = rng.standard_normal((256, 512)).astype(np.float32)
    rec, glob = ListRecorder(), ListRecorder()
    with recording(glob):
        simulate_kernel(gemm_kernel, (lhsT, rhs), {}, recorder=rec)
    ops = [e.op for e in rec.events]
    assert ops == ["dma_copy", "dma_copy", "nc_matmul"] * 2 + ["tensor_copy", "dma_copy"]
    assert glob.events == rec.events
    assert [e.engine for e in rec.events][:3] == ["dma", "dma", "tensor"]


def test_cost_only_mode_skips_math_but_validates_and_records():
    rec = ListRecorder()
    start = time.perf_counter()
    out = simulate_kernel(gemm_kernel, (ShapeSpec((1024, 1024), ml_dtypes.bfloat16),
                                        ShapeSpec((1024, 2048), ml_dtypes.bfloat16)), {}, recorder=rec, execute=False)
    elapsed = time.perf_counter() - start
    assert out is None
    n_mm = sum(e.op == "nc_matmul" for e in rec.events)
    assert n_mm == 8 * 4 * 8 and all(e.matmul_kmn == (128, 128, 512) for e in rec.events if e.op == "nc_matmul")
    assert elapsed < 30   # generous bound: only guards against accidentally doing the math (not a perf assertion)
    with pytest.raises(SimulationError, match="partition dimension"):
        simulate_kernel(lambda a: nisa.memset(dst=nl.ndarray((256, 4), nl.float32, buffer=nl.sbuf), value=0.0),
                        (ShapeSpec((4, 4), np.float32),), {}, execute=False)


@pytest.mark.parametrize("kernel,engine", [
    (lambda t, s: nisa.activation(dst=s, op=nl.exp, data=t), "scalar"),
    (lambda t, s: nisa.iota(dst=s, pattern=[[1, 8]]), "gpsimd"),
    (lambda t, s: nisa.tensor_scalar(dst=s, data=t, op0=nl.add, operand0=1.0), "vector"),
    (lambda t, s: nisa.memset(dst=s, value=0.0, engine=nisa.gpsimd_engine), "gpsimd"),
    (lambda t, s: nisa.tensor_copy(dst=s, src=t, engine=nisa.engine.scalar), "scalar"),
])
def test_engine_attribution(kernel, engine):
    rec = ListRecorder()

    def k():
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        kernel(t, s)

    simulate_kernel(k, (), {}, recorder=rec, execute=False)
    assert [e.engine for e in rec.events] == [engine]


def test_language_wrappers(rng):
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((64, 48)).astype(np.float32)

    def kernel(a_hbm, b_hbm):
        x, y = nl.load(a_hbm), nl.load(b_hbm)
        mm = nl.matmul(x, y, transpose_x=True)           # [32, 48] = a.T @ b
        mm2 = nl.matmul(nl.copy(nl.transpose(x)), y)    # [M=32, K=64] operand: PE-transposed back first
        e = nl.exp(x)
        s = nl.add(x, 1.0)
        r = nl.sum(x, axis=1)
        out1 = nl.ndarray((32, 48), nl.float32, buffer=nl.shared_hbm)
        nl.store(out1, nl.copy(mm))
        outs = [out1]
        for t in (mm2, e, s, r):
            outs.append(hbm_out(t))
        return tuple(outs)

    mm, mm2, e, s, r = run(kernel, a, b)
    a64 = a.astype(np.float64)
    np.testing.assert_allclose(mm, a64.T @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mm2, a64.T @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(e, np.exp(a64), rtol=1e-6)
    np.testing.assert_array_equal(s, a + np.float32(1))
    np.testing.assert_allclose(r[:, 0], a64.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_language_store_of_psum_is_rejected():
    def kernel(x_hbm):
        p = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nl.store(x_hbm, p)

    with pytest.raises(SimulationError, match="nl.store of a PSUM tile is not supported"):
        run(kernel, np.zeros((4, 4), np.float32))


def test_collectives_outside_a_kernel_raise():
    import nki.collectives as cc

    with pytest.raises(SimulationError, match="outside a running kernel"):
        cc.rank_id()


def test_nki_calls_outside_a_kernel_raise():
    with pytest.raises(SimulationError, match="outside a running kernel"):
        nl.ndarray((4, 4), nl.float32)


def test_nested_tuple_and_dict_arguments_are_converted(rng):
    a, b = rng.standard_normal((2, 4, 4)).astype(np.float32)

    def kernel(pair, named):
        x, y = sbuf_in(pair[0]), sbuf_in(named["w"])
        z = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=z, data1=x, data2=y, op=nl.add)
        return hbm_out(z)

    np.testing.assert_array_equal(run(kernel, (a, 3), {"w": b}), a + b)
    with pytest.raises(SimulationError, match="is a list; NKI kernels take tuples"):
        run(kernel, [a], {"w": b})


def test_nki_simulator_env_keeps_jit_on_the_simulator(monkeypatch, rng):
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    x = rng.standard_normal((4, 4)).astype(np.float32)
    np.testing.assert_array_equal(nki.jit(lambda t: hbm_out(sbuf_in(t)))(x), x)


def test_language_allocation_helpers(rng):
    c = rng.standard_normal((4, 3)).astype(np.float32)

    def kernel():
        z = nl.zeros((4, 3), nl.float32)
        o = nl.ones((4, 3), nl.int32)
        f = nl.full((4, 3), 2.5, nl.bfloat16, buffer=nl.shared_hbm)
        zl = nl.zeros_like(z, dtype=nl.float16)
        el = nl.empty_like(z)
        const = nl.shared_constant(c)
        flags = (nl.is_sbuf(z.buffer), nl.is_psum(z.buffer), nl.is_hbm(f.buffer), nl.is_on_chip(nl.psum))
        assert flags == (True, False, True, True) and el.shape == (4, 3) and el.buffer is nl.sbuf
        return hbm_out(z), hbm_out(o), f, hbm_out(zl), const

    z, o, f, zl, const = run(kernel)
    assert (z == 0).all() and (o == 1).all() and (f.astype(np.float32) == 2.5).all() and (zl == 0).all()
    assert zl.dtype == np.float16
    np.testing.assert_array_equal(const, c)


def test_documented_but_unsimulated_api_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="nisa.tensor_scalar_cumulative is documented"):
        nisa.tensor_scalar_cumulative  # noqa: B018
    with pytest.raises(NotImplementedError, match="nl.softmax is documented"):
        nl.softmax  # noqa: B018
    with pytest.raises(AttributeError):
        nisa.no_such_instruction  # noqa: B018


def test_nl_copy_is_a_vector_tensor_copy_and_an_activation_op(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x_hbm):
        t = sbuf_in(x_hbm)
        c = nl.copy(t, dtype=nl.bfloat16)
        a = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=a, op=nl.copy, data=t)
        return hbm_out(c), hbm_out(a)

    rec = ListRecorder()
    c, a = run(kernel, x, recorder=rec)
    assert [e.engine for e in rec.events if e.op in ("tensor_copy", "activation")] == ["vector", "scalar"]
    np.testing.assert_array_equal(c.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(a, x)


def test_jit_function_called_inside_a_kernel_is_inlined(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    @nki.jit
    def double(t):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        return t

    def kernel(x_hbm):
        return hbm_out(double(sbuf_in(x_hbm)))

    np.testing.assert_array_equal(run(kernel, x), 2 * x)
