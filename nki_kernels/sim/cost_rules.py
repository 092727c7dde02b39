"""Per-instruction cost rules of the NKI cost model (an ESTIMATE built from published figures, not a measurement).

Each function maps one ``InstrEvent`` to engine cycles (compute engines) or seconds (DMA) using the rules of
the public NKI documentation §9 as collected in ``cost_constants.py``. ``cost.py`` aggregates them into a report.

Conventions the interpreter and this model share:
* ``free_elems`` = elements per partition processed by the instruction (for matmul: moving free size N).
* ``matmul_kmn`` = (K, M, N) with K the *logical* contraction length of the instruction: 128 rows for a plain
  matmul, 256 for ``perf_mode="double_row"`` (128 partitions x 2), 512 for ``nc_matmul_mx`` (128 partitions x 4).
  The cycle count does not depend on K (the array streams one moving column per cycle whatever the packing); the
  FLOP count does (2*K*M*N).
"""
from __future__ import annotations

from . import cost_constants as C

_TWO_BYTE_FLOATS = frozenset({"bfloat16", "float16"})
_FP8 = frozenset({"float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
_FP32_LIKE = frozenset({"float32", "tfloat32", "tf32"})


def matmul_mode(ev) -> str:
    """Throughput class of a TensorE matmul event: "mx", "double_row", "fp32" or "bf16" (bf16/fp16/tf32/fp8)."""
    if ev.perf_mode == "mx" or ev.op == "nc_matmul_mx":
        return "mx"
    if ev.perf_mode == "double_row":
        return "double_row"
    if ev.perf_mode not in (None, "", "none"):
        raise ValueError(f"cost model: unknown matmul perf_mode {ev.perf_mode!r} in {ev}")
    # §9.2/§9.1: fp32 inputs run at 1/4 rate; TF32 runs at the bf16 rate. The interpreter reports tf32 operands as
    # "float32" storage unless told otherwise, so a tf32 matmul is charged as fp32 here (conservative).
    if ev.in_dtype in _FP32_LIKE and ev.in_dtype != "tfloat32":
        return "fp32"
    return "bf16"


def peak_flops_for(mode: str, g: C.GenerationConstants, generation: str) -> float:
    """Tensor Engine peak FLOP/s of one core for a matmul mode (raises if the generation lacks the mode)."""
    peak = {"bf16": g.bf16_peak_flops, "fp32": g.fp32_peak_flops,
            "double_row": g.double_row_peak_flops, "mx": g.mx_peak_flops}[mode]
    if peak <= 0:
        raise ValueError(f"cost model: matmul mode {mode!r} does not exist on {generation} "
                         f"(double_row needs gen3+, MX needs gen4); fix the kernel or the target generation")
    return peak


def tensor_cycles(ev) -> int:
    """TensorE cycles of one instruction (§9.2), including the per-instruction fixed overhead."""
    if ev.op in ("nc_matmul", "nc_matmul_mx"):
        if ev.matmul_kmn is None:
            raise ValueError(f"cost model: matmul event without matmul_kmn: {ev}")
        _k, m, n = ev.matmul_kmn
        # §9.2: II = max(min(64, M), N): one moving column per cycle, but at least min(64, M) cycles per
        # instruction (MM_INIT_LATENCY; a stationary narrower than 64 shortens that floor).
        ii = max(min(C.MM_STATIONARY_FLOOR, m), n)
        if matmul_mode(ev) == "fp32":
            ii *= C.MM_FP32_FACTOR                       # §9.2: 4x for fp32 inputs
        # double_row (K=256) and MX (K=512) take the bf16 instruction time for 2x / 4x the FLOPs (§9.2, §5.7).
        return ii + C.INSTR_FIXED_CYCLES
    if ev.op == "nc_transpose":
        # §9.2: TensorE transpose ≈ max(P, min(64, F)) cycles back-to-back.
        return max(ev.partitions, min(C.TRANSPOSE_FREE_FLOOR, ev.free_elems)) + C.INSTR_FIXED_CYCLES
    # Anything else on TensorE (not expected): charge like a moving stream of free_elems columns.
    return max(C.MIN_II, ev.free_elems) + C.INSTR_FIXED_CYCLES


def _both_2byte(ev) -> bool:
    return ev.in_dtype in _TWO_BYTE_FLOATS and ev.out_dtype in _TWO_BYTE_FLOATS


def _vector_perf_divisor(ev, g: C.GenerationConstants) -> int:
    """§9.3 automatic VectorE perf modes (v3, applied on v4 too): 4x / 2x for bf16/fp16 data."""
    if not g.vector_perf_modes or not _both_2byte(ev):
        return 1
    in_sbuf, out_sbuf = ev.src_buffer == "sbuf", ev.dst_buffer == "sbuf"
    if ev.op in ("tensor_copy", "tensor_scalar"):
        if in_sbuf and out_sbuf:
            return 4                                      # SBUF, bf16/fp16 in & out, unit inner stride
        if ev.src_buffer == "psum" or ev.dst_buffer == "psum":
            return 2                                      # one side in PSUM
    if ev.op == "tensor_tensor" and in_sbuf:
        return 2                                          # both inputs SBUF bf16/fp16 (only main input is known)
    return 1


def vector_like_cycles(ev, g: C.GenerationConstants, perf_modes: bool = True) -> tuple[float, bool]:
    """Vector/GpSimd cycles (§9.3) and whether a specific rule (not the generic max(MIN_II, N)) matched."""
    n, op = ev.free_elems, ev.op
    bf16_in = ev.in_dtype == "bfloat16"
    if op == "tensor_tensor":
        base = n if ev.src_buffer == "psum" else 2 * n  # 2N, but N when an input is in PSUM
        base /= _vector_perf_divisor(ev, g) if perf_modes else 1
    elif op == "tensor_reduce":
        # N/2 for bf16 in+out with add/max, else N (the ALU op is not in the event: add/max assumed).
        base = n / 2 if (bf16_in and ev.out_dtype == "bfloat16") else n
    elif op == "scalar_tensor_tensor":
        base = n if bf16_in else 2 * n                    # N for bf16 (sub, mul), else 2N
    elif op == "tensor_tensor_scan":
        base = 2 * n
    elif op == "tensor_copy_predicated":
        base = n if ev.src_buffer != ev.dst_buffer else 2 * n  # mixed SBUF/PSUM: N, both SBUF: 2N
    elif op == "bn_aggr":
        base = C.BN_AGGR_FACTOR * n
    elif op == "tensor_scalar_reduce":
        base = n + C.MIN_II
    elif op == "reciprocal":
        base = C.VECTOR_RECIPROCAL_FACTOR * n
    elif op == "exponential":
        base = n / C.VECTOR_EXP_SPEEDUP                   # v4: 4x ScalarE exp (which is N cycles)
    elif op == "quantize_mx":
        base = n / C.QUANTIZE_MX_ELEMS_PER_CYCLE
    elif op in ("iota", "affine_select"):
        return C.GPSIMD_START_CYCLES + n + C.INSTR_FIXED_CYCLES, True   # §9.3: 150 + N
    else:
        base = n / (_vector_perf_divisor(ev, g) if perf_modes else 1)
        known = op in _SINGLE_INPUT_VECTOR_OPS
        return max(C.MIN_II, base) + C.INSTR_FIXED_CYCLES, known
    return max(C.MIN_II, base) + C.INSTR_FIXED_CYCLES, True


# §9.3 "VectorE single-input ops ... ≈ max(MIN_II, N)" plus ops the reference lists with the same N-rule.
_SINGLE_INPUT_VECTOR_OPS = frozenset({
    "tensor_scalar", "tensor_copy", "memset", "nc_stream_shuffle", "max8", "nc_find_index8",
    "nc_match_replace8", "bn_stats", "range_select", "select_reduce", "tensor_scalar_cumulative",
    "nc_transpose",
})


def scalar_cycles(ev, g: C.GenerationConstants) -> tuple[float, bool]:
    """ScalarE cycles (§9.3): max(MIN_II, N); +~64 for the accumulator read-out of activation_reduce."""
    n = ev.free_elems
    if g.scalar_bf16_2x and (ev.in_dtype in _TWO_BYTE_FLOATS | _FP8) and (ev.out_dtype in _TWO_BYTE_FLOATS | _FP8):
        n = n / 2                                         # v4 ScalarE: 256 bf16/fp16/fp8 elems/cycle (§9.1, §9.3)
    cycles = max(C.MIN_II, n) + C.INSTR_FIXED_CYCLES
    if ev.op == "activation_reduce":
        cycles += C.ACT_READOUT_CYCLES
    known = ev.op in ("activation", "activation_reduce", "activate2", "tensor_scalar", "tensor_copy")
    return cycles, known


def dma_seconds(ev, g: C.GenerationConstants) -> tuple[float, float]:
    """(occupancy_s, serial_s) of one DMA (§9.4): bytes / per-core BW, plus the fixed cost (shared by 16 queues
    for occupancy, whole for the serialised bound)."""
    bw = g.dma_bytes_per_s
    if ev.op == "dma_transpose":
        bw *= C.DMA_TRANSPOSE_HBM_EFF if ev.src_buffer == "hbm" else C.DMA_TRANSPOSE_SBUF_EFF
    stream = ev.dma_bytes / bw
    return stream + C.DMA_FIXED_S / C.DMA_QUEUES, stream + C.DMA_FIXED_S
