"""One test per cost-model rule, each expected value derived by hand in a comment from the NKI documentation

Numbers used below (all from §9 via nki_kernels/sim/cost_constants.py):
  clocks: TensorE 2.8 / 2.4 / 2.4 GHz, VectorE 1.12 / 0.96 / 1.2 GHz, ScalarE & GpSimd 1.4 / 1.2 / 1.2 GHz (gen2/3/4)
  MIN_II = 64 cycles, per-instruction fixed overhead = 60 cycles (SBUF/PSUM access start),
  DMA 272 / 368 / 528 GB/s per core, fixed 1.3 us per transfer shared by 16 queues (81.25 ns occupancy).
"""
import pytest

from nki_kernels.sim.cost import CostModel, estimate
from nki_kernels.sim.events import InstrEvent

REL = 1e-12  # pure float arithmetic on the same formula: only rounding differences are tolerated


def mm(k=128, m=128, n=512, dtype="bfloat16", perf_mode=None, op="nc_matmul"):
    return InstrEvent("tensor", op, k, n, dtype, "float32", matmul_kmn=(k, m, n), perf_mode=perf_mode,
                      src_buffer="sbuf", dst_buffer="psum")


def vec(op, n, dtype="float32", out=None, src="sbuf", dst="sbuf", engine="vector"):
    return InstrEvent(engine, op, 128, n, dtype, out or dtype, src_buffer=src, dst_buffer=dst)


def dma(nbytes, src="hbm", dst="sbuf", op="dma_copy"):
    return InstrEvent("dma", op, 128, nbytes // 256, "bfloat16", "bfloat16", dma_bytes=nbytes,
                      src_buffer=src, dst_buffer=dst)


def busy(events, gen, engine):
    return estimate(events, gen).engine_busy_s[engine]


# ----------------------------------------------------------------------------------------------- Tensor Engine
def test_matmul_ii_full_tile_gen2():
    # max(min(64, 128), 512) = 512 cycles + 60 fixed = 572 cycles at 2.8 GHz = 204.29 ns
    assert busy([mm()], "gen2", "tensor") == pytest.approx(572 / 2.8e9, rel=REL)


def test_matmul_ii_small_moving_is_floored_by_stationary():
    # N=32 < 64: max(min(64, 128), 32) = 64 (+60) = 124 cycles
    assert busy([mm(n=32)], "gen2", "tensor") == pytest.approx(124 / 2.8e9, rel=REL)
    # narrow stationary lowers the floor: max(min(64, 32), 16) = 32 (+60) = 92 cycles
    assert busy([mm(m=32, n=16)], "gen2", "tensor") == pytest.approx(92 / 2.8e9, rel=REL)


def test_matmul_ii_gen3_clock():
    # same 572 cycles at the 2.4 GHz v3 TensorE clock
    assert busy([mm()], "trn2", "tensor") == pytest.approx(572 / 2.4e9, rel=REL)


def test_matmul_fp32_is_4x():
    # fp32 inputs: 4 * 512 = 2048 (+60) = 2108 cycles
    assert busy([mm(dtype="float32")], "gen2", "tensor") == pytest.approx(2108 / 2.8e9, rel=REL)
    rep = estimate([mm(dtype="float32")], "gen2")
    # peak-time of 2*128*128*512 FLOPs at the fp32 peak (91.75/4 TFLOPS) = 4*512 cycles → fraction 2048/2108
    assert rep.tensor_peak_fraction == pytest.approx(2048 / 2108, rel=1e-9)
    assert rep.matmul_mode == "fp32"


def test_double_row_fp8_doubles_throughput():
    ev = mm(k=256, dtype="float8_e4m3", perf_mode="double_row")
    rep = estimate([ev], "gen3")
    # instruction time = bf16 time: 572 cycles at 2.4 GHz; FLOPs = 2*256*128*512 = 33,554,432
    assert rep.engine_busy_s["tensor"] == pytest.approx(572 / 2.4e9, rel=REL)
    assert rep.flops == 33_554_432
    # double_row peak = 2 * 128*128*2*2.4e9 → peak time = 512 cycles → fraction 512/572 (as bf16 at K=128)
    assert rep.tensor_peak_fraction == pytest.approx(512 / 572, rel=1e-9)
    assert rep.matmul_mode == "double_row"
    # twice the FLOPs of a bf16 matmul in the same time
    assert rep.flops / estimate([mm()], "gen3").flops == 2


def test_double_row_absent_on_gen2():
    with pytest.raises(ValueError, match="double_row"):
        estimate([mm(k=256, dtype="float8_e4m3", perf_mode="double_row")], "gen2")


def test_mx_matmul_is_4x_bf16():
    ev = mm(k=512, n=2048, dtype="float8_e4m3fn", perf_mode="mx", op="nc_matmul_mx")
    rep = estimate([ev], "gen4")
    # N=2048 (v4 allows up to 4096): max(64, 2048) + 60 = 2108 cycles at 2.4 GHz
    assert rep.engine_busy_s["tensor"] == pytest.approx(2108 / 2.4e9, rel=REL)
    # FLOPs = 2*512*128*2048; MX peak = 4*bf16 peak → peak time = 2048 cycles → fraction 2048/2108
    assert rep.flops == 2 * 512 * 128 * 2048
    assert rep.tensor_peak_fraction == pytest.approx(2048 / 2108, rel=1e-9)
    with pytest.raises(ValueError, match="MX"):
        estimate([ev], "gen3")


def test_tensor_transpose():
    ev = InstrEvent("tensor", "nc_transpose", 128, 32, "bfloat16", "bfloat16")
    # max(P=128, min(64, 32)) = 128 (+60) = 188 cycles
    assert busy([ev], "gen2", "tensor") == pytest.approx(188 / 2.8e9, rel=REL)


# ----------------------------------------------------------------------------------------------- Vector Engine
def test_vector_single_input_rule():
    # tensor_scalar fp32 N=512: max(64, 512) + 60 = 572 cycles at 1.12 GHz
    assert busy([vec("tensor_scalar", 512)], "gen2", "vector") == pytest.approx(572 / 1.12e9, rel=REL)
    # tiny N=10: MIN_II 64 + 60 = 124 cycles
    assert busy([vec("tensor_copy", 10)], "gen2", "vector") == pytest.approx(124 / 1.12e9, rel=REL)


def test_vector_perf_mode_gen3():
    # v3 bf16 SBUF->SBUF tensor_copy: 4x → 512/4 = 128 (+60) = 188 cycles at 0.96 GHz
    assert busy([vec("tensor_copy", 512, "bfloat16")], "gen3", "vector") == pytest.approx(188 / 0.96e9, rel=REL)
    # one side in PSUM: 2x → 256 + 60 = 316 cycles
    ev = vec("tensor_copy", 512, "bfloat16", src="psum")
    assert busy([ev], "gen3", "vector") == pytest.approx(316 / 0.96e9, rel=REL)
    # fp32 PSUM -> bf16 eviction: not both 2-byte → no perf mode: 572 cycles
    ev = vec("tensor_copy", 512, "float32", out="bfloat16", src="psum")
    assert busy([ev], "gen3", "vector") == pytest.approx(572 / 0.96e9, rel=REL)
    # no perf modes on gen2: 572 cycles at 1.12 GHz
    assert busy([vec("tensor_copy", 512, "bfloat16")], "gen2", "vector") == pytest.approx(572 / 1.12e9, rel=REL)


def test_tensor_tensor_rule():
    # two SBUF inputs: 2N = 1024 (+60) = 1084 cycles; an input in PSUM: N = 512 (+60) = 572
    assert busy([vec("tensor_tensor", 512)], "gen2", "vector") == pytest.approx(1084 / 1.12e9, rel=REL)
    assert busy([vec("tensor_tensor", 512, src="psum")], "gen2", "vector") == pytest.approx(572 / 1.12e9, rel=REL)
    # v3 bf16 both SBUF: 2N / 2 = 512 (+60) = 572 cycles at 0.96 GHz
    ev = vec("tensor_tensor", 512, "bfloat16")
    assert busy([ev], "gen3", "vector") == pytest.approx(572 / 0.96e9, rel=REL)


def test_vector_specific_rules():
    cases = [
        (vec("tensor_reduce", 512, "bfloat16"), 256 + 60),        # N/2 for bf16 in+out
        (vec("tensor_reduce", 512), 512 + 60),                    # N otherwise
        (vec("reciprocal", 512), 8 * 512 + 60),                   # max(MIN_II, 8N)
        (vec("tensor_scalar_reduce", 512), 512 + 64 + 60),        # N + MIN_II
        (vec("bn_aggr", 48), 13 * 48 / 3 + 60),                   # 13N/3 = 208
        (vec("scalar_tensor_tensor", 512), 2 * 512 + 60),         # 2N for non-bf16
        (vec("scalar_tensor_tensor", 512, "bfloat16"), 512 + 60),  # N for bf16
        (vec("tensor_tensor_scan", 100), 200 + 60),               # 2N
        (vec("tensor_copy_predicated", 512), 1024 + 60),          # both SBUF: 2N
    ]
    for ev, cycles in cases:
        assert busy([ev], "gen2", "vector") == pytest.approx(cycles / 1.12e9, rel=REL), ev.op


def test_gen4_vector_rules():
    # quantize_mx: 4 elems/partition/cycle → 512/4 = 128 (+60) = 188 cycles at 1.2 GHz
    assert busy([vec("quantize_mx", 512, "bfloat16", out="float8_e4m3fn")], "gen4", "vector") == \
        pytest.approx(188 / 1.2e9, rel=REL)
    # VectorE exponential: 4x ScalarE exp → 512/4 = 128 (+60) = 188 cycles
    assert busy([vec("exponential", 512)], "gen4", "vector") == pytest.approx(188 / 1.2e9, rel=REL)


# ----------------------------------------------------------------------------------------- Scalar and GpSimd
def test_scalar_activation():
    ev = InstrEvent("scalar", "activation", 128, 512, "float32", "float32", src_buffer="psum", dst_buffer="sbuf")
    # max(64, 512) + 60 = 572 cycles at 1.4 GHz
    assert busy([ev], "gen2", "scalar") == pytest.approx(572 / 1.4e9, rel=REL)
    red = InstrEvent("scalar", "activation_reduce", 128, 512, "float32", "float32")
    # + ~64-cycle accumulator read-out = 636 cycles
    assert busy([red], "gen2", "scalar") == pytest.approx(636 / 1.4e9, rel=REL)
    bf = InstrEvent("scalar", "activation", 128, 512, "bfloat16", "bfloat16")
    # v4 ScalarE 256-wide for bf16: 256 + 60 = 316 cycles at 1.2 GHz
    assert busy([bf], "gen4", "scalar") == pytest.approx(316 / 1.2e9, rel=REL)


def test_gpsimd_start_cost():
    # iota / affine_select: 150 (GPSIMD_START) + N + 60 = 722 cycles at 1.4 GHz for N=512
    for op in ("iota", "affine_select"):
        ev = vec(op, 512, "int32", engine="gpsimd")
        assert busy([ev], "gen2", "gpsimd") == pytest.approx(722 / 1.4e9, rel=REL), op


# ------------------------------------------------------------------------------------------------------- DMA
def test_dma_bandwidth_and_fixed_cost():
    nbytes = 131072  # a [128, 512] bf16 tile
    for gen, bw in (("gen2", 272e9), ("gen3", 368e9), ("gen4", 528e9)):
        rep = estimate([dma(nbytes)], gen)
        # occupancy = bytes / BW + 1.3 us / 16 queues; gen2: 481.88 ns + 81.25 ns = 563.13 ns
        assert rep.engine_busy_s["dma"] == pytest.approx(nbytes / bw + 1.3e-6 / 16, rel=REL)
        # serialised bound pays the full 1.3 us: gen2 481.88 + 1300 = 1781.88 ns
        assert rep.upper_bound_s == pytest.approx(nbytes / bw + 1.3e-6, rel=REL)
        assert rep.dma_bytes == nbytes and rep.hbm_bytes == nbytes and rep.dma_transfers == 1
    # many tiny DMAs are dominated by the fixed cost: 1000 x 512 B on gen2 → 1000 * (1.88 ns + 81.25 ns)
    rep = estimate([dma(512)] * 1000, "gen2")
    assert rep.engine_busy_s["dma"] == pytest.approx(1000 * (512 / 272e9 + 1.3e-6 / 16), rel=1e-9)


def test_dma_transpose_and_hbm_accounting():
    # SBUF->SBUF DMA transpose at 50% of copy BW: 131072 / (368e9 * 0.5) + 81.25 ns on gen3
    ev = dma(131072, src="sbuf", op="dma_transpose")
    assert busy([ev], "gen3", "dma") == pytest.approx(131072 / 184e9 + 1.3e-6 / 16, rel=REL)
    assert estimate([ev], "gen3").hbm_bytes == 0
    # HBM->HBM copies touch HBM twice (read + write)
    assert estimate([dma(4096, src="hbm", dst="hbm")], "gen2").hbm_bytes == 8192


# ---------------------------------------------------------------------------------------------------- report
def test_report_bounds_and_fractions():
    events = [mm()] * 10 + [dma(131072)] * 2 + [vec("tensor_copy", 512, src="psum")]
    rep = estimate(events, "gen2")
    t, d, v = 10 * 572 / 2.8e9, 2 * (131072 / 272e9 + 1.3e-6 / 16), 572 / 1.12e9
    assert rep.lower_bound_s == pytest.approx(max(t, d, v), rel=REL)
    assert rep.bound_engine == "tensor"
    # serialised: every engine's busy time plus the non-overlapped part of each DMA's fixed cost
    assert rep.upper_bound_s == pytest.approx(t + d + v + 2 * (1.3e-6 - 1.3e-6 / 16), rel=REL)
    assert rep.tensor_peak_fraction == pytest.approx(10 * 512 / 2.8e9 / rep.lower_bound_s, rel=1e-9)
    assert rep.hbm_bw_fraction == pytest.approx(2 * 131072 / 410e9 / rep.lower_bound_s, rel=1e-9)
    d = rep.to_dict()
    assert d["engine_busy_s"]["tensor"] == pytest.approx(t) and d["ops"][0]["engine"] == "dma"
    text = str(rep)
    assert "ESTIMATE" in text and "bound by tensor" in text and "89.5%" in text


def test_generic_rule_is_reported_and_recorder_resets():
    model = CostModel("trn3")
    model.record(vec("some_future_op", 512))
    rep = model.report()
    assert [o.op for o in rep.ops if o.generic_rule] == ["some_future_op"]
    assert "some_future_op" in str(rep)
    model.reset()
    assert model.report().lower_bound_s == 0.0 and model.report().bound_engine == "none"


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="generation"):
        CostModel("trn9")
    with pytest.raises(ValueError, match="engine"):
        estimate([vec("tensor_copy", 8, engine="sync")], "gen2")
    with pytest.raises(ValueError, match="matmul_kmn"):
        estimate([InstrEvent("tensor", "nc_matmul", 128, 512, "bfloat16", "float32")], "gen2")


def test_generation_from_run_is_required_outside_a_run():
    # generation=None means "take it from the simulated run"; a plain event list has no run → clear error
    with pytest.raises(ValueError, match="inside a simulated run"):
        CostModel(None).record(mm())


def test_report_dict_is_json_serialisable():
    import json

    rep = estimate([mm(), dma(4096), vec("tensor_copy", 64)], "trn2")
    back = json.loads(json.dumps(rep.to_dict()))
    assert back["generation"] == "gen3" and back["engine_instructions"] == {
        "tensor": 1, "vector": 1, "scalar": 0, "gpsimd": 0, "dma": 1}
    assert back["lower_bound_s"] == rep.lower_bound_s and len(back["ops"]) == 3
