"""Every remaining validation rule of the simulator triggered once (the per-instruction files cover the rest).

Each case is a tiny kernel body that breaks exactly one rule; the test checks the message names the problem.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError

from .conftest import run


def sb(shape=(4, 8), dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def ps(shape=(4, 8), dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


CASES = {
    # ---- dtypes / allocation -------------------------------------------------------------------------------
    "unknown dtype name": (lambda: sb(dtype="float33"), "unknown dtype name 'float33'"),
    "not a dtype": (lambda: sb(dtype=3.5), "is not a dtype"),
    "unsupported dtype": (lambda: sb(dtype=np.complex64), "not supported by NKI"),
    "non-positive shape": (lambda: sb((4, 0)), "must have positive sizes"),
    "buffer not an object": (lambda: nl.ndarray((4, 4), nl.float32, buffer=3), "buffer must be nl.sbuf"),
    "x4 computed write": (lambda: nisa.tensor_tensor(dst=sb((32, 4), nl.float8_e4m3fn_x4), data1=sb((32, 4)),
                                                     data2=sb((32, 4)), op=nl.add),
                          "cannot write computed values into a packed"),
    "x4 arithmetic read": (lambda: nisa.tensor_copy(dst=sb((32, 4)), src=sb((32, 4), nl.float8_e5m2_x4)),
                           "packed MX data cannot be converted"),
    "x4 activation read": (lambda: nisa.activation(dst=sb((32, 4)), op=nl.exp, data=sb((32, 4), nl.float8_e5m2_x4)),
                           "can only feed nc_matmul_mx"),
    # ---- views -------------------------------------------------------------------------------------------------
    "too many indices": (lambda: sb()[0, 0, 0], "too many indices"),
    "newaxis": (lambda: sb()[None], "np.newaxis indexing is not supported"),
    "two ellipses": (lambda: sb()[..., ...], "at most one Ellipsis"),
    "float slice bound": (lambda: sb()[0.5:2], "unsupported index 0.5"),
    "string index": (lambda: sb()[:, "a"], "unsupported index 'a'"),
    "ap out of range read": (lambda: nisa.tensor_copy(dst=sb((4, 9)), src=sb().ap([[8, 4], [1, 9]])), "outside tensor"),
    "ap malformed": (lambda: sb().ap([[8, 4, 1]]), "list of \\[stride, count\\] pairs"),
    "ap vector_offset": (lambda: sb().ap([[8, 4], [1, 8]], vector_offset=sb((4, 1), nl.int32)),
                         "addresses an HBM tensor"),
    "view misaligned": (lambda: sb((4, 3), nl.bfloat16).view(nl.float32), "is a multiple of 4 B"),
    "view strided last dim": (lambda: sb((4, 8), nl.bfloat16)[:, 0:8:2].view(nl.float32), "contiguous last dim"),
    "reshape non-contiguous": (lambda: sb()[:, 0:8:2].reshape((4, 2, 2)), "reshape of non-contiguous view"),
    "reshape partition dim": (lambda: sb().reshape((8, 4)), "must keep the partition dim 4"),
    "reshape element count": (lambda: sb().reshape((4, 3)), "changes the element count"),
    "reshape two -1": (lambda: sb().reshape((-1, -1)), "at most one -1"),
    "broadcast non-1 dim": (lambda: sb().broadcast(1, 4), "needs a size-1 free dim"),
    "broadcast partition dim": (lambda: sb((1, 8)).broadcast(0, 4), "needs a size-1 free dim"),
    "squeeze non-1 dim": (lambda: sb().squeeze_dim(1), "squeeze_dim\\(1\\) on a dim of size 8"),
    "permute partition dim": (lambda: sb((4, 2, 3)).permute((1, 0, 2)), "keeping dim 0 first on-chip"),
    "dim out of range": (lambda: sb().slice(3, 0, 1), "dimension 3 out of range"),
    "scalar_offset tensor size": (lambda: sb().ap([[8, 4], [1, 8]], scalar_offset=sb((2, 2), nl.int32)),
                                  "must hold exactly one element"),
    # ---- operand checks --------------------------------------------------------------------------------------
    "operand not a tensor": (lambda: nisa.tensor_copy(dst=sb(), src=np.zeros((4, 8))), "src must be an NKI tensor"),
    "engine not allowed": (lambda: nisa.tensor_copy(dst=sb(), src=sb(), engine=nisa.engine.tensor),
                           "cannot run on the tensor engine"),
    "scalar operand type": (lambda: nisa.tensor_scalar(dst=sb(), data=sb(), op0=nl.add, operand0="x"),
                            "must be a number or a \\(P, 1\\) tile"),
    "op not an nki operator": (lambda: nisa.tensor_tensor(dst=sb(), data1=sb(), data2=sb(), op="add"),
                               "is not an NKI operator"),
    "numpy ufunc accepted": (lambda: nisa.tensor_tensor(dst=sb(), data1=sb(), data2=sb(), op=np.sin),
                             "must be a binary ALU operator"),
    # ---- data movement -------------------------------------------------------------------------------------
    "dma to psum": (lambda: nisa.dma_copy(dst=ps(), src=sb()), "dma_copy dst must be in HBM or SBUF"),
    "dma_transpose rank": (lambda: nisa.dma_transpose(dst=sb((8, 4), nl.bfloat16), src=sb((4, 2, 4), nl.bfloat16)),
                           "dst rank 2 must equal src rank 3"),
    "dma_transpose axes": (lambda: nisa.dma_transpose(dst=sb((4, 8), nl.bfloat16), src=sb((4, 8), nl.bfloat16),
                                                      axes=(0, 1)), "axes \\(0, 1\\) not supported"),
    "dma_transpose shape": (lambda: nisa.dma_transpose(dst=sb((4, 8), nl.bfloat16), src=sb((4, 8), nl.bfloat16)),
                            "must be the permuted src shape \\(8, 4\\)"),
    "dma_transpose psum dst": (lambda: nisa.dma_transpose(dst=ps((8, 4), nl.bfloat16), src=sb((4, 8), nl.bfloat16)),
                               "dma_transpose dst must be in SBUF"),
    "memset non-number": (lambda: nisa.memset(dst=sb(), value="0"), "value must be a Python number"),
    "memset gpsimd psum": (lambda: nisa.memset(dst=ps(), value=0.0, engine=nisa.gpsimd_engine),
                           "memset dst must be in SBUF"),
    "iota malformed pattern": (lambda: nisa.iota(dst=sb(), pattern=[[1, 2, 3]]), "must be 1-4 \\[step, count\\]"),
    # ---- vector / gpsimd -----------------------------------------------------------------------------------
    "gpsimd tensor_tensor psum": (lambda: nisa.tensor_tensor(dst=sb(), data1=ps(), data2=sb(), op=nl.add,
                                                             engine=nisa.engine.gpsimd), "on GpSimd cannot access PSUM"),
    "tensor_scalar gpsimd op": (lambda: nisa.tensor_scalar(dst=sb(), data=sb(), op0=nl.add, operand0=1.0,
                                                           engine=nisa.engine.gpsimd), "supports only nl.rsqrt"),
    "tensor_scalar scalar engine gen2": (lambda: nisa.tensor_scalar(dst=sb(), data=sb(), op0=nl.add, operand0=1.0,
                                                                    engine=nisa.engine.scalar),
                                         "on the scalar engine requires NeuronCore gen3", "trn1"),
    "stt bitvec": (lambda: nisa.scalar_tensor_tensor(dst=sb(), data=sb(), op0=nl.bitwise_and, operand0=1,
                                                     op1=nl.add, operand1=sb()), "arithmetic operators only"),
    "stt both psum": (lambda: nisa.scalar_tensor_tensor(dst=sb(), data=ps(), op0=nl.add, operand0=1.0, op1=nl.add,
                                                        operand1=ps()), "cannot both be in PSUM"),
    "tensor_reduce not reducible": (lambda: nisa.tensor_reduce(dst=sb((4, 1)), op=nl.subtract, data=sb(), axis=1),
                                    "is not reducible"),
    "tsr reduce_op": (lambda: nisa.tensor_scalar_reduce(dst=sb(), data=sb(), op0=nl.add, operand0=0.0,
                                                        reduce_op=nl.subtract), "reduce_op must be one of nl.add"),
    "select on_false type": (lambda: nisa.affine_select(dst=sb(), pattern=[[1, 8]], channel_multiplier=0,
                                                        on_true_tile=sb(), on_false_value="x"), "must be a number"),
    "select_reduce op": (lambda: nisa.select_reduce(dst=sb(), predicate=sb(), on_true=sb(), on_false=0.0,
                                                    reduce_op=nl.add), "reduce_op must be one of nl.maximum"),
    "activation_reduce without res": (lambda: nisa.activation_reduce(dst=sb(), op=nl.exp, data=sb(),
                                                                     reduce_op=nl.add, reduce_res=None),
                                      "needs reduce_op=nl.add and reduce_res"),
    "reduce_res shape": (lambda: nisa.activation(dst=sb(), op=nl.exp, data=sb(), reduce_res=sb((4, 2)),
                                                 reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_op=nl.add),
                         "reduce_res must have shape \\(4, 1\\)"),
    # ---- tensor engine ------------------------------------------------------------------------------------
    "matmul accumulate value": (lambda: nisa.nc_matmul(dst=ps((8, 8)), stationary=sb((4, 8), nl.bfloat16),
                                                       moving=sb((4, 8), nl.bfloat16), accumulate=1),
                                "accumulate must be None, True or False"),
    "matmul dst shape": (lambda: nisa.nc_matmul(dst=ps((8, 4)), stationary=sb((4, 8), nl.bfloat16),
                                                moving=sb((4, 8), nl.bfloat16)), "dst \\(8, 4\\) must be \\[M=8, N=8\\]"),
    "matmul tiling half set": (lambda: nisa.nc_matmul(dst=ps((8, 8)), stationary=sb((4, 8), nl.bfloat16),
                                                      moving=sb((4, 8), nl.bfloat16), tile_size=(64, 64)),
                               "must be set together"),
    "matmul tiling size": (lambda: nisa.nc_matmul(dst=ps((8, 8)), stationary=sb((4, 8), nl.bfloat16),
                                                  moving=sb((4, 8), nl.bfloat16), tile_position=(0, 16),
                                                  tile_size=(32, 32)), "a multiple of it", "trn1"),
    "matmul perf_mode enum": (lambda: nisa.nc_matmul(dst=ps((8, 8)), stationary=sb((4, 8), nl.bfloat16),
                                                     moving=sb((4, 8), nl.bfloat16), perf_mode="double_row"),
                              "must be a nisa.matmul_perf_mode member"),
    "double_row shape": (lambda: nisa.nc_matmul(dst=ps((8, 8)), stationary=sb((4, 8), nl.float8_e4m3),
                                                moving=sb((4, 8), nl.float8_e4m3),
                                                perf_mode=nisa.matmul_perf_mode.double_row),
                         "needs \\[K, 2, M\\] and \\[K, 2, N\\]"),
    "transpose mode identity shape": (lambda: nisa.nc_matmul(dst=ps((8, 4), nl.bfloat16),
                                                             stationary=sb((4, 8), nl.bfloat16),
                                                             moving=sb((4, 8), nl.bfloat16), is_transpose=True),
                                      "needs a \\[4, 4\\] identity moving tile"),
    "transpose mode dst dtype": (lambda: nisa.nc_matmul(dst=ps((8, 4), nl.float16), stationary=sb((4, 8), nl.bfloat16),
                                                        moving=sb((4, 4), nl.bfloat16), is_transpose=True),
                                 "writes the stationary dtype bfloat16"),
    "nc_transpose dst shape": (lambda: nisa.nc_transpose(dst=ps((4, 8)), data=sb((4, 8))), "dst must be \\[8, 4\\]"),
    "nc_transpose tensor buffers": (lambda: nisa.nc_transpose(dst=sb((8, 4)), data=sb((4, 8)),
                                                              engine=nisa.engine.tensor), "dst must be in PSUM"),
    # ---- MX ------------------------------------------------------------------------------------------------
    "quantize_mx dst shape": (lambda: nisa.quantize_mx(dst=sb((32, 2), nl.float8_e4m3fn_x4),
                                                       src=sb((32, 16), nl.bfloat16), dst_scale=sb((32, 4), nl.uint8)),
                              "dst must be \\[32, 4\\] x4 words"),
    "quantize_mx scale dtype": (lambda: nisa.quantize_mx(dst=sb((32, 4), nl.float8_e4m3fn_x4),
                                                         src=sb((32, 16), nl.bfloat16),
                                                         dst_scale=sb((32, 4), nl.float32)),
                                "must be float8_e8m0fnu or uint8"),
    "quantize_mx scale size": (lambda: nisa.quantize_mx(dst=sb((32, 4), nl.float8_e4m3fn_x4),
                                                        src=sb((32, 16), nl.bfloat16), dst_scale=sb((32, 2), nl.uint8)),
                               "dst_scale must have 4 elements per partition"),
    "matmul_mx dst dtype": (lambda: nisa.nc_matmul_mx(dst=ps((4, 4), nl.float16), stationary=sb((32, 4),
                                                      nl.float8_e4m3fn_x4), moving=sb((32, 4), nl.float8_e4m3fn_x4),
                                                      stationary_scale=sb((32, 4), nl.uint8),
                                                      moving_scale=sb((32, 4), nl.uint8)),
                            "dst must be fp32 or bf16 PSUM"),
    "matmul_mx scale size": (lambda: nisa.nc_matmul_mx(dst=ps((4, 4)), stationary=sb((32, 4), nl.float8_e4m3fn_x4),
                                                       moving=sb((32, 4), nl.float8_e4m3fn_x4),
                                                       stationary_scale=sb((32, 2), nl.uint8),
                                                       moving_scale=sb((32, 4), nl.uint8)),
                             "stationary_scale must have 4 elements per partition"),
    # ---- language / SPMD ---------------------------------------------------------------------------------
    "program_id axis": (lambda: nl.program_id(1), "program_id\\(axis=1\\)"),
    "num_programs axes": (lambda: nl.num_programs(axes=1), "num_programs\\(axes=1\\)"),
    "nl.load of on-chip": (lambda: nl.load(sb()), "nl.load reads an HBM tensor"),
    "nl.load of 1-D": (lambda: nl.load(nl.ndarray((8,), nl.float32, buffer=nl.hbm)), "needs a >= 2-D HBM view"),
    "nl op arity": (lambda: nl.add(sb(), sb(), sb()), "takes one or two operands"),
    "nl op without tensor": (lambda: nl.add(1.0, 2.0), "needs at least one tensor argument"),
    "activation tf32 bias": (lambda: nisa.activation(dst=sb(), op=nl.exp, data=sb(), bias=sb((4, 1), nl.tfloat32)),
                             "except tfloat32"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_validation_rule(name):
    body, match, *target = CASES[name]

    def kernel():
        body()

    with pytest.raises(SimulationError, match=match):
        run(kernel, target=target[0] if target else "trn3")


def test_lnc2_programs_must_allocate_shared_outputs_identically():
    def kernel():
        rows = 4 if nl.program_id(0) == 0 else 8
        return nl.ndarray((rows, 4), nl.float32, buffer=nl.shared_hbm)

    with pytest.raises(SimulationError, match="control flow must match across cores"):
        run(kernel, lnc=2)


def test_invalid_precise_fp_env(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "yes")
    with pytest.raises(SimulationError, match="NKI_PRECISE_FP must be 0 or 1"):
        run(lambda: None)


def test_view_needs_precise_fp(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")
    with pytest.raises(SimulationError, match="needs NKI_PRECISE_FP=1"):
        run(lambda: sb((4, 8), nl.bfloat16).view(nl.uint16))


def test_simulate_rejects_non_callables():
    import nki

    with pytest.raises(SimulationError, match="expected a kernel function"):
        nki.simulate(42)


def test_fori_loop_runs_in_order_but_not_inside_no_reorder():
    seen = []

    def kernel():
        nl.fori_loop(2, 8, seen.append, step=3)
        with nl.no_reorder():
            nl.fori_loop(0, 1, seen.append)

    with pytest.raises(SimulationError, match="not allowed inside a nl.no_reorder"):
        run(kernel)
    assert seen == [2, 5]


def test_tensor_scalar_binary_op1_needs_operand1():
    def kernel():
        nisa.tensor_scalar(dst=sb(), data=sb(), op0=nl.add, operand0=1.0, op1=nl.multiply)

    with pytest.raises(SimulationError, match="operand1 must be a number"):
        run(kernel)
