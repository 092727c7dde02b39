"""Every number the NKI cost model uses, in one table, each with its source.

All figures are published vendor figures as collected in the public NKI documentation (section given per entry;
"§9.1" = section 9.1 of that file). Entries the reference itself marks UNCERTAIN, and choices that are ours
rather than the documentation's ("OUR READING"), say so in their comment. Nothing here was measured on hardware.

Generations: ``gen2`` = NeuronCore-v2 (Trn1/Inf2), ``gen3`` = NeuronCore-v3 (Trn2), ``gen4`` = NeuronCore-v4 (Trn3).
"""
from __future__ import annotations

from dataclasses import dataclass

GENERATIONS = ("gen2", "gen3", "gen4")
# Aliases accepted wherever a generation is named (same spelling as NEURON_PLATFORM_TARGET_OVERRIDE, §1.3).
GENERATION_ALIASES = {"trn1": "gen2", "inf2": "gen2", "trn2": "gen3", "trn3": "gen4",
                      "gen2": "gen2", "gen3": "gen3", "gen4": "gen4"}


@dataclass(frozen=True)
class GenerationConstants:
    """Per-NeuronCore figures for one generation (all per core, not per chip)."""

    # --- clocks (Hz), §9.1 table rows "TensorE clock", "VectorE clock", "ScalarE clock", "GpSimd" ---
    tensor_hz: float
    vector_hz: float
    scalar_hz: float
    gpsimd_hz: float
    # --- Tensor Engine peaks (FLOP/s per core), §9.1 "TensorE dense TFLOPS / core" ---
    bf16_peak_flops: float          # BF16/FP16/TF32 (and cFP8 on v2)
    fp32_peak_flops: float          # FP32 = 1/4 of BF16 (§9.2 "4x for fp32")
    double_row_peak_flops: float    # FP8 perf_mode=double_row (v3/v4 only; 0 = not available)
    mx_peak_flops: float            # MXFP8/MXFP4 nc_matmul_mx (v4 only; 0 = not available)
    # --- DMA / HBM, §9.4 ---
    dma_bytes_per_s: float          # practical DMA peak per core (16 engines x 17/23/33 B/ns)
    hbm_bytes_per_s: float          # per-core share of chip HBM bandwidth (chip BW / cores per chip)
    # --- VectorE / ScalarE bf16 perf modes, §9.3 ---
    vector_perf_modes: bool         # v3 (and v4, see comment) 2x/4x automatic bf16/fp16 modes
    scalar_bf16_2x: bool            # v4 ScalarE runs 2-byte/fp8 data at 2x (256-wide)
    vector_exponential: bool        # v4 VectorE `exponential` = 4x ScalarE exp


GEN = {
    "gen2": GenerationConstants(
        tensor_hz=2.8e9, vector_hz=1.12e9, scalar_hz=1.4e9, gpsimd_hz=1.4e9,            # §9.1
        # 128x128 PEs x 2 FLOP x 2.8 GHz = 91.8 TFLOPS (§9.1 "Sanity"); vendor says 92. We use the PE arithmetic so
        # that a perfectly streamed matmul is exactly 100% of peak under the §9.2 initiation-interval rule.
        bf16_peak_flops=128 * 128 * 2 * 2.8e9,
        fp32_peak_flops=128 * 128 * 2 * 2.8e9 / 4,                                        # §9.1: 23 TFLOPS FP32
        double_row_peak_flops=0.0, mx_peak_flops=0.0,                                     # v3+/v4-only modes (§5.1, §5.7)
        dma_bytes_per_s=272e9,                                                            # §9.4: 16 x 17 B/ns
        hbm_bytes_per_s=820e9 / 2,                                                        # §9.4: Trn1 820 GB/s / 2 cores
        vector_perf_modes=False, scalar_bf16_2x=False, vector_exponential=False,
    ),
    "gen3": GenerationConstants(
        tensor_hz=2.4e9, vector_hz=0.96e9, scalar_hz=1.2e9, gpsimd_hz=1.2e9,             # §9.1
        bf16_peak_flops=128 * 128 * 2 * 2.4e9,                                            # 78.6 (vendor 79) TFLOPS
        fp32_peak_flops=128 * 128 * 2 * 2.4e9 / 4,                                        # vendor 20 TFLOPS
        double_row_peak_flops=2 * 128 * 128 * 2 * 2.4e9,                                  # §9.1: 158 FP8 double_row
        mx_peak_flops=0.0,
        dma_bytes_per_s=368e9,                                                            # §9.4: 16 x 23 B/ns
        hbm_bytes_per_s=2.9e12 / 8,                                                       # §9.4: 2.9 TB/s / 8 cores
        vector_perf_modes=True, scalar_bf16_2x=False, vector_exponential=False,
    ),
    "gen4": GenerationConstants(
        tensor_hz=2.4e9, vector_hz=1.2e9, scalar_hz=1.2e9, gpsimd_hz=1.2e9,              # §9.1
        bf16_peak_flops=128 * 128 * 2 * 2.4e9,
        fp32_peak_flops=128 * 128 * 2 * 2.4e9 / 4,
        # §9.1: plain FP8 double_row on v4 "presumably 158 — UNCERTAIN"; we assume the v3 figure.
        double_row_peak_flops=2 * 128 * 128 * 2 * 2.4e9,
        mx_peak_flops=4 * 128 * 128 * 2 * 2.4e9,                                          # §9.1/§5.7: 315 MXFP8/4 = 4x
        dma_bytes_per_s=528e9,                                                            # §9.4: 16 x 33 B/ns
        hbm_bytes_per_s=4.9e12 / 8,                  # §9.4: 4.9 TB/s / 8 (NKI guide says 4.7 TB/s — UNCERTAIN)
        # §9.3 describes the VectorE perf modes for v3; the §9.1 width row gives v4 the same 512 bf16 elems/cycle,
        # so we apply them on v4 too (OUR READING, UNCERTAIN).
        vector_perf_modes=True, scalar_bf16_2x=True, vector_exponential=True,
    ),
}

# ---------------------------------------------------------------------------------------------------------------
# Engine-independent rules (cycles are in the clock of the engine that runs the instruction)
# ---------------------------------------------------------------------------------------------------------------
# §9.2: matmul initiation interval = max(min(MM_STATIONARY_FLOOR, M), N) TensorE cycles, M = stationary free size,
# N = moving free size (the 64 is MM_INIT_LATENCY ≈ 64 cycles on v2).
MM_STATIONARY_FLOOR = 64
# §9.2: "4x that for fp32" inputs (fp32 peak = 1/4 of bf16 peak in §9.1). TF32 runs at the bf16 rate (§9.1).
MM_FP32_FACTOR = 4
# §9.2: TensorE transpose cycles ≈ max(P, min(64, F)) back-to-back (v2 figure; used for all generations).
TRANSPOSE_FREE_FLOOR = 64

# §9.3: MIN_II ≈ 64 engine cycles (minimum initiation interval of Vector/Scalar/GpSimd instructions).
MIN_II = 64
# §9.3 "Fixed overheads: ~60 cycles to start an SBUF/PSUM access (v2)". OUR READING: every compute instruction
# (TensorE included) starts at least one SBUF/PSUM access, so we add this once per instruction on every engine and
# every generation (the reference gives it for v2 only — UNCERTAIN for v3/v4). Without it the §9.2 II rule alone
# predicts exactly 100% of TensorE peak for a stream of 128x128x512 matmuls; with it, 512/572 = 89.5%.
INSTR_FIXED_CYCLES = 60
# §9.3: ScalarE activation with a reduce_res adds an accumulator read-out instruction of ~MIN_II cycles.
ACT_READOUT_CYCLES = 64
# §9.3: GPSIMD_START ≈ 150 cycles for iota / affine_select (cost 150 + N).
GPSIMD_START_CYCLES = 150
# §9.3: VectorE reciprocal ≈ max(MIN_II, 8N).
VECTOR_RECIPROCAL_FACTOR = 8
# §9.3: bn_aggr ≈ 13N/3.
BN_AGGR_FACTOR = 13 / 3
# §9.3: v4 quantize_mx processes 4 elements/partition/cycle; v4 VectorE exponential is 4x ScalarE exp.
QUANTIZE_MX_ELEMS_PER_CYCLE = 4
VECTOR_EXP_SPEEDUP = 4

# §9.4 DMA. Per-transfer fixed cost ≈ 1.3 µs (descriptor + semaphore, cross-engine); HWDGE ≈ 600 ns (v3 only, and
# the event does not say which DGE was used). We use 1.3 µs on every generation (the figure the reference gives for
# a transfer in general; v2 has no HWDGE). It is a *latency*: each of the 16 DMA engines has 16 queues, so up to
# DMA_QUEUES transfers overlap their fixed costs. The perfect-overlap bound therefore charges fixed/DMA_QUEUES of
# DMA occupancy per transfer; the serialised bound charges the full fixed cost (OUR READING).
DMA_FIXED_S = 1.3e-6
DMA_QUEUES = 16
# §9.4: DMA transpose runs at ~90% of copy bandwidth HBM->SBUF and ~50% SBUF->SBUF (v3 figures, used everywhere).
DMA_TRANSPOSE_HBM_EFF = 0.9
DMA_TRANSPOSE_SBUF_EFF = 0.5

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


def resolve_generation(generation: str) -> str:
    """Map ``trn1``/``inf2``/``trn2``/``trn3``/``genN`` to the canonical ``genN`` name (raises on anything else)."""
    key = str(generation).strip().lower()
    if key not in GENERATION_ALIASES:
        raise ValueError(f"unknown Neuron generation {generation!r}: use one of {sorted(GENERATION_ALIASES)}")
    return GENERATION_ALIASES[key]
