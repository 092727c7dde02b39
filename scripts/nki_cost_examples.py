"""Print cost-model reports (ESTIMATES from published figures, see nki_kernels/sim/cost_constants.py) for the calibration kernels.

Runs nki_kernels/examples/gemm_blocked.py and gemm_naive.py at the published calibration shape
(bf16 [4096, 8192] @ [8192, 8192], one NeuronCore) in the simulator's cost-only mode (validation and events, no
NumPy math), plus a large elementwise add, and prints each report next to the published figure.

    python scripts/nki_cost_examples.py [--gen trn1] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import ml_dtypes

import nki_kernels  # noqa: F401  (registers the simulator as `nki` when the real package is absent)
from nki_kernels.sim.cost import cost_kernel

PUBLISHED = {"gemm_blocked": "Trn1 measured 6.97 ms = 85.2% of TensorE peak",
             "gemm_naive": "Trn1 measured 51.8 ms = 11% of TensorE peak"}


def _cost_only(kernel, args, generation: str):
    """Run ``kernel(*args)`` in cost-only mode and return (report, wall seconds of the simulation)."""
    t0 = time.perf_counter()
    report = cost_kernel(kernel, args, generation=generation)
    return report, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", default="trn1", help="trn1|trn2|trn3 (or gen2|gen3|gen4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per kernel")
    ns = ap.parse_args()

    from nki.simulator import ShapeSpec

    from nki_kernels.examples.gemm_blocked import gemm_blocked
    from nki_kernels.examples.gemm_naive import gemm_naive
    from nki_kernels.examples.tensor_add import tensor_add_kernel

    bf16 = ml_dtypes.bfloat16
    K, M, N = 8192, 4096, 8192
    lhsT = ShapeSpec((K, M), bf16)   # [K, M] = A transposed; shapes only (cost-only mode allocates no data)
    rhs = ShapeSpec((K, N), bf16)    # [K, N]
    x = ShapeSpec((8192, 8192), bf16)
    runs = [("gemm_blocked", gemm_blocked, (lhsT, rhs)), ("gemm_naive", gemm_naive, (lhsT, rhs)),
            ("elementwise_add 8192x8192 bf16", tensor_add_kernel, (x, x))]
    for name, kernel, args in runs:
        rep, wall = _cost_only(kernel, args, ns.gen)
        if ns.json:
            print(json.dumps({"kernel": name, "sim_wall_s": wall, **rep.to_dict()}))
            continue
        print(f"== {name} ({PUBLISHED.get(name, 'no published figure')}); simulated in {wall:.1f} s")
        print(rep)
        print()


if __name__ == "__main__":
    main()
