"""Print cost-model reports (ESTIMATES, nki-reference.md §9) for the calibration kernels.

Runs nki_kernels/examples/gemm_blocked.py and gemm_naive.py at the published calibration shape
(bf16 [4096, 8192] @ [8192, 8192], one NeuronCore) in the simulator's cost-only mode (validation and events, no
NumPy math), plus a large elementwise add, and prints each report next to the published figure.

    /tmp/v/bin/python scripts/nki_cost_examples.py [--gen trn1] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

import nki_kernels  # noqa: F401  (registers the simulator as `nki` when the real package is absent)
from nki_kernels.sim.cost import CostModel

PUBLISHED = {"gemm_blocked": "Trn1 measured 6.97 ms = 85.2% of TensorE peak",
             "gemm_naive": "Trn1 measured 51.8 ms = 11% of TensorE peak"}


def _cost_only(kernel, args, generation: str):
    """Run ``kernel(*args)`` in cost-only mode and return (report, wall seconds of the simulation)."""
    from nki.simulator import simulate_kernel

    model = CostModel(generation)
    t0 = time.perf_counter()
    simulate_kernel(kernel, args, {}, lnc=1, recorder=model, execute=False)
    return model.report(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", default="trn1", help="trn1|trn2|trn3 (or gen2|gen3|gen4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per kernel")
    ns = ap.parse_args()

    from nki_kernels.examples.gemm_blocked import gemm_blocked
    from nki_kernels.examples.gemm_naive import gemm_naive

    bf16 = ml_dtypes.bfloat16
    K, M, N = 8192, 4096, 8192
    lhsT = np.zeros((K, M), dtype=bf16)   # [K, M] = A transposed; values unused in cost-only mode
    rhs = np.zeros((K, N), dtype=bf16)    # [K, N]
    x = np.zeros((8192, 8192), dtype=bf16)
    runs = [("gemm_blocked", gemm_blocked, (lhsT, rhs)), ("gemm_naive", gemm_naive, (lhsT, rhs))]
    add = _elementwise_kernel()
    if add is not None:
        runs.append(("elementwise_add", add, (x, x)))
    for name, kernel, args in runs:
        rep, wall = _cost_only(kernel, args, ns.gen)
        if ns.json:
            print(json.dumps({"kernel": name, "sim_wall_s": wall, **rep.to_dict()}))
            continue
        print(f"== {name} ({PUBLISHED.get(name, 'no published figure')}); simulated in {wall:.1f} s")
        print(rep)
        print()


def _elementwise_kernel():
    """The simulator's tensor-add example kernel if present (owned by the interpreter's examples)."""
    try:
        from nki_kernels.examples.tensor_add import tensor_add
    except ImportError:
        return None
    return tensor_add


if __name__ == "__main__":
    main()
