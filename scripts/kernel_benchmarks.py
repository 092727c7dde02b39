"""Generate nki_kernels/BENCHMARKS.md: cost-model estimates of the NKI kernels at realistic per-core shapes.

Every kernel runs on the NumPy NKI simulator in cost-only mode (`execute=False`: instructions are validated and
recorded, no math is done) with `nki_kernels.sim.cost.CostModel` as the recorder. Numbers are ESTIMATES from the
published figures (nki_kernels/sim/cost_constants.py), not measurements.

    python scripts/kernel_benchmarks.py            # writes nki_kernels/BENCHMARKS.md
    python scripts/kernel_benchmarks.py --stdout   # print instead
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ml_dtypes
import numpy as np

import nki_kernels  # noqa: F401  (registers the simulator as `nki`)
from nki_kernels.attention_decode.kernel import attention_decode
from nki_kernels.attention_prefill.kernel import flash_attention_prefill
from nki_kernels.mlp.kernel import mlp_fp8_kernel, mlp_kernel
from nki_kernels.mx_matmul.kernel import mx_matmul_kernel
from nki_kernels.sim import ShapeSpec, simulate_kernel
from nki_kernels.sim.cost import CostModel
from nki_kernels.sim.cost_constants import GEN, resolve_generation


@dataclass(frozen=True)
class PerCore:
    """Per-NeuronCore slice of a Llama model under tensor parallelism (KV heads replicated when tp > n_kv)."""

    name: str
    hidden: int
    q_heads: int
    kv_heads: int
    inter: int
    head_dim: int = 128


def per_core(name, hidden, heads, kv_heads, inter, tp) -> PerCore:
    return PerCore(f"{name} tp{tp}", hidden, max(1, heads // tp), max(1, kv_heads // tp), inter // tp)


MODELS = (
    per_core("Llama-3.1-8B", 4096, 32, 8, 14336, 8),
    per_core("Llama-3.1-8B", 4096, 32, 8, 14336, 32),
    per_core("Llama-3.1-70B", 8192, 64, 8, 28672, 32),
)
BF16, FP32, FP8 = ml_dtypes.bfloat16, np.float32, ml_dtypes.float8_e4m3   # = nl.bfloat16, nl.float32, nl.float8_e4m3
GOALS = {"prefill attention": ("TE", 0.70), "decode attention": ("HBM", 0.80), "prefill MLP": ("TE", 0.70),
         "decode MLP": ("HBM", 0.80), "MX matmul prefill": ("MX", 0.70), "MX matmul decode": ("HBM", 0.80)}


def spec(*shape, dt=BF16):
    return ShapeSpec(tuple(shape), dt)


def tiled(k, n, dt=BF16):
    return spec(128, -(-n // 128), -(-k // 128), 128, dt=dt)


def run_cost(kernel, args, target):
    model = CostModel(target)
    simulate_kernel(kernel, args, recorder=model, execute=False, target=target)
    return model.report()


def cases():
    """(kernel family, model, shape label, targets, kernel, args, useful matmul FLOPs)."""
    out = []
    for m in MODELS:
        q_to_kv = tuple(h * m.kv_heads // m.q_heads for h in range(m.q_heads))
        d, scale = m.head_dim, m.head_dim ** -0.5
        for s in (2048, 8192):
            args = (spec(1, m.q_heads, d, s), spec(1, m.kv_heads, d, s), spec(1, m.kv_heads, s, d), q_to_kv, scale)
            causal = 4.0 * d * s * (s + 1) / 2 * m.q_heads          # QK^T + PV over the visible pairs only
            out.append(("prefill attention", m, f"S={s}", ("trn1", "trn2", "trn3"), flash_attention_prefill, args,
                        causal))
        for b in (1, 8):
            for s in (2048, 8192):
                args = (spec(b, m.q_heads, d, 1), spec(b, m.kv_heads, d, s), spec(b, m.kv_heads, s, d),
                        spec(b, 1, dt=FP32), q_to_kv, scale)
                out.append(("decode attention", m, f"B={b} cache={s}", ("trn1", "trn2", "trn3"), attention_decode,
                            args, 4.0 * d * s * b * m.q_heads))
        w = (tiled(m.hidden, m.inter), tiled(m.hidden, m.inter), tiled(m.inter, m.hidden))
        w8 = tuple(tiled(*kn, dt=FP8) for kn in ((m.hidden, m.inter), (m.hidden, m.inter), (m.inter, m.hidden)))
        sc = (spec(128, -(-m.inter // 128), dt=FP32),) * 2 + (spec(128, m.hidden // 128, dt=FP32),)
        mlp_flops = 6.0 * m.hidden * m.inter   # per token: gate, up, down (unpadded sizes)
        for n in (2048, 8192):
            out.append(("prefill MLP", m, f"bf16 N={n}", ("trn1", "trn2", "trn3"), mlp_kernel, (spec(n, m.hidden), *w),
                        mlp_flops * n))
        for n in (1, 8):
            out.append(("decode MLP", m, f"bf16 N={n}", ("trn1", "trn2", "trn3"), mlp_kernel, (spec(n, m.hidden), *w),
                        mlp_flops * n))
            out.append(("decode MLP", m, f"fp8 N={n}", ("trn2", "trn3"), mlp_fp8_kernel,
                        (spec(n, m.hidden), *w8, *sc), mlp_flops * n))
        k, f = m.hidden, 2 * m.inter   # fused gate+up projection
        mx_w = (spec(k // 4, f, dt=np.uint32), spec(k // 32, f, dt=np.uint8))
        out.append(("MX matmul prefill", m, f"MXFP8 gate+up N=2048 K={k} F={f}", ("trn3",), mx_matmul_kernel,
                    (spec(2048, k), *mx_w), 2.0 * 2048 * k * f))
        out.append(("MX matmul decode", m, f"MXFP8 gate+up N=8 K={k} F={f}", ("trn3",), mx_matmul_kernel,
                    (spec(8, k), *mx_w), 2.0 * 8 * k * f))
    return out


def peak_flops(kind, target):
    g = GEN[resolve_generation(target)]
    return g.mx_peak_flops if kind == "MX" else g.bf16_peak_flops


def metric(family, report, useful_flops, target):
    """(kind, value at the lower bound, value at the upper bound, goal). TE/MX fractions count only useful
    FLOPs (no masked-out causal work, no zero padding), so they can be lower than the cost model's own figure."""
    kind, goal = GOALS[family]
    if kind == "HBM":
        serial = report.hbm_bw_fraction * report.lower_bound_s / report.upper_bound_s
        return kind, report.hbm_bw_fraction, serial, goal
    ideal = useful_flops / peak_flops(kind, target)
    return kind, ideal / report.lower_bound_s, ideal / report.upper_bound_s, goal


def rows():
    table = []
    for family, m, label, targets, kernel, args, flops in cases():
        for target in targets:
            r = run_cost(kernel, args, target)
            kind, value, serial, goal = metric(family, r, flops, target)
            table.append((family, m.name, label, target, r, kind, value, serial, goal))
    return table


def _pct(x):
    """Percent rounded *down*, so a value shown as 80% always meets an 80% goal (79.6% shows as 79%)."""
    return f"{math.floor(x * 100 + 1e-9)}%"


def _fmt_t(s):
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def render(table) -> str:
    lines = [
        "# NKI kernel cost estimates",
        "",
        "Generated by `scripts/kernel_benchmarks.py` (do not edit by hand). **ESTIMATES** from the NKI cost model",
        "(`nki_kernels/sim/cost.py`, published figures in `cost_constants.py`) over the simulator's",
        "instruction stream in cost-only mode; nothing here was measured on hardware. One NeuronCore, LNC1.",
        "",
        "Metric: fraction of Tensor Engine peak (TE: bf16 peak; MX: MXFP8/4 peak) for compute-bound kernels —",
        "*useful* FLOPs only (causal pairs, unpadded sizes) over the estimated time — or of the per-core HBM",
        "bandwidth share for memory-bound ones, at the cost model's *lower bound* (perfect overlap of the",
        "engines). `serial` is the same metric at the upper bound (no overlap at all); real kernels land in",
        "between. Percentages are rounded down.",
        "",
        "| kernel | model (per core) | shape | target | est. time | bound by | metric | goal | met | serial |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family, model, label, target, r, kind, value, serial, goal in table:
        met = "yes" if value >= goal else "**no**"
        lines.append(f"| {family} | {model} | {label} | {target} | {_fmt_t(r.lower_bound_s)} | {r.bound_engine} | "
                     f"{_pct(value)} {kind} | {goal:.0%} | {met} | {_pct(serial)} |")
    lines += ["", *summary(table), "", NOTES]
    return "\n".join(lines) + "\n"


def summary(table):
    """Goals met per kernel family and target, and the HBM ceiling the DMA peak imposes per generation."""
    out = ["## Summary", "", "| kernel | target | goal met | range of the metric |", "|---|---|---|---|"]
    keys = sorted({(row[0], row[3]) for row in table}, key=lambda k: (list(GOALS).index(k[0]), k[1]))
    for family, target in keys:
        vals = [row[6] for row in table if row[0] == family and row[3] == target]
        met = sum(v >= GOALS[family][1] for v in vals)
        out.append(f"| {family} | {target} | {met}/{len(vals)} | {_pct(min(vals))} .. {_pct(max(vals))} "
                   f"{GOALS[family][0]} |")
    out += ["", "Ceiling of the HBM fraction in this model (practical DMA peak / per-core HBM share): " + ", ".join(
        f"{t} {min(1.0, GEN[resolve_generation(t)].dma_bytes_per_s / GEN[resolve_generation(t)].hbm_bytes_per_s):.0%}"
        for t in ("trn1", "trn2", "trn3")) + "."]
    return out


NOTES = """## Why goals are missed (structural, from the cost model's rules)

* **Prefill attention** misses on trn1/trn2 because of VectorE: the row max of every fp32 score tile costs one
  VectorE cycle per key at 1.12 / 0.96 GHz, while TensorE spends ~2 cycles per key (QK^T + PV, 128 rows) at
  2.8 / 2.4 GHz; on trn2 that one reduce alone takes 1.3-1.4x the ideal TensorE time (a 70-75% ceiling before any
  other work). The P transposes (SBUF->SBUF dma_transpose at half the copy bandwidth) then bound the short
  prompts on trn2/trn3. The kernel already re-balances (the small ScalarE instructions on GpSimd, a quarter of the
  P transposes on TensorE for prompts up to 2048 tokens on trn3); reaching 70% everywhere would need an
  algorithmic change (e.g. PV with V stationary over several query heads, o^T layout), not a re-balance.
* **Memory-bound kernels on trn1 / trn3** are capped by the ceiling above (the practical DMA peak is below the
  per-core HBM share); on trn2 the same kernels reach 90%+. Decode attention at batch 1 with a 2k cache moves
  1 MiB in 5 DMAs (q, bounds, K, V, out) whose fixed costs alone keep it below 80% on trn3; at batch 8 the K/V of
  two rows share a DMA, and TensorE (35 small matmuls/transposes per row) is as busy as the DMA queues.
* **FP8 decode MLP** is TensorE-bound: a 128x128 FP8 weight tile moves in 74 TensorE cycles of DMA time on trn3
  but its matmul costs the 124-cycle minimum (64 + 60 fixed). Halving the instruction count needs double_row
  (FP8 x FP8, i.e. quantized activations), which the weight-only FP8 variant does not use.
* **Prefill MLP at Llama-3.1-8B tp32** (I = 448): the tiled layout pads I to 512 (12.5% idle TensorE work); on
  trn1 (no DMA transpose) x also goes through TensorE transposes, which weigh more against the narrow
  intermediate.

## Where the estimate is weakest

* **Engine overlap.** The headline figure assumes perfect overlap of TensorE, VectorE, ScalarE, GpSimd and DMA
  (no dependency stalls, no semaphore waits, no PSUM bank conflicts). Flash attention is a chain of dependent
  instructions per tile (matmul -> max -> exp -> transpose -> matmul); without software pipelining across tiles
  (our kernels rely on the compiler's scheduling) real time is closer to the `serial` column.
* **Fixed instruction costs.** The model charges 60 cycles per instruction and a 64-cycle minimum initiation
  interval (v2 figures, applied to every generation). Kernels with many small instructions (decode attention,
  the [128, 1] softmax statistics) are dominated by these two constants.
* **DMA.** Bandwidth is bytes / practical per-core DMA peak plus 1.3 us per transfer shared by 16 queues; strided
  or element-granular access patterns (the V [S, D] -> [128, S/128, D] loads, the 4-row scale loads of the MX
  kernel, the x quad-layout dma_transpose) are charged as if they were contiguous. On trn1 the practical DMA
  peak (272 GB/s) is below the HBM share (410 GB/s), capping any memory-bound kernel at 66% HBM there.
* **Transposes.** `dma_transpose` (P tiles of prefill attention on gen3+, the MX activations, the bf16 MLP input
  on gen3+) is charged at 90% /
  50% of copy bandwidth (HBM / SBUF source); its real throughput depends on the DGE mode and element size. Our
  3-D / 4-D transposes have a leading dim of 128, outside the documented HWDGE form (leading dim 1..16); neither
  the simulator nor the model checks which DGE would run them — the least certain part of the gen3+ numbers.
* **trn1.** Current NKI documentation lists Trn2 and Trn3 only; the trn1 rows use the NC-v2 figures as a
  reference point.
* **MX and FP8 rates.** MX matmuls are charged the bf16 instruction time for 4x the FLOPs (315 TFLOPS/core);
  `quantize_mx` at 4 elements/partition/cycle. FP8 weights multiplied by bf16 activations run at the bf16 rate
  (no double_row), so the FP8 MLP saves HBM bytes, not TensorE time.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdout", action="store_true", help="print the table instead of writing BENCHMARKS.md")
    args = ap.parse_args(argv)
    text = render(rows())
    if args.stdout:
        print(text)
    else:
        path = ROOT / "nki_kernels" / "BENCHMARKS.md"
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
