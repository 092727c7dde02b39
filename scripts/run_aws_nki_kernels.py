"""Run AWS's published current-API NKI kernels on the neuron-infer NKI simulator and compare with their references.

Usage (checkouts of github.com/aws-neuron/aws-neuron-sdk and github.com/aws-neuron/nki-library, any path):

    python scripts/run_aws_nki_kernels.py --sdk ~/src/aws-neuron-sdk --nki-library ~/src/nki-library [-k mamba]

Nothing from those repositories is copied here: each case names a file and a kernel in the user's checkout, builds
small random inputs, runs the kernel through ``nki.simulate`` (our simulator registered as ``nki``; collective
kernels once per rank through ``nki.simulator.simulate_ranks``) and compares the result with the reference the
repository publishes next to the kernel (its NumPy/torch function) or, where it has none, with a NumPy expression of
the kernel's documented result. Prints one line per case, the cases by status and how many kernels ran and matched
(per repository); exit status 1 if any case failed, 2 on a bad checkout path. nki-library's kernels need torch (its
references) and SciPy (rotational_topk imports it) in the environment.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from aws_nki_cases import all_cases

import nki_kernels  # noqa: F401  (registers the simulator as `nki`)


def load(path: Path, name: str | None = None):
    """Import a file of the user's checkout as a module (its directory is put on sys.path for sibling imports)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name or f"aws_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(case, roots) -> tuple[str, str]:
    root = roots.get(case.repo)
    if root is None:
        return "skip", f"no --{case.repo} checkout given"
    rng = np.random.default_rng(0)
    try:
        case.run(root, load, rng)
    except AssertionError as exc:
        if "mismatch" in str(exc):
            return "FAIL", str(exc).splitlines()[0][:200]
        return "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    except Exception as exc:  # noqa: BLE001 - reported per case
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return "ERROR", f"{type(exc).__name__}: {str(exc)[:200]} ({Path(tb.filename).name}:{tb.lineno})"
    return "ok", ""


def summarize(results) -> list[str]:
    """Report lines for [(case, status)]: the cases by status, then how many kernels ran and matched (a kernel
    counts as matched when every case that exercises it did; skipped cases are not attempted), per repository."""
    by_status, kernels = {}, {}
    for case, status in results:
        by_status[status] = by_status.get(status, 0) + 1
        if status != "skip":
            key = (case.repo, case.kernel_name)
            kernels[key] = kernels.get(key, True) and status == "ok"
    cases_ok = by_status.get("ok", 0)
    cases_run = sum(n for s, n in by_status.items() if s != "skip")
    per_repo = []
    for repo in sorted({r for r, _ in kernels}, key=lambda r: (r != "sdk", r)):
        ok = [v for (r, _), v in kernels.items() if r == repo]
        per_repo.append(f"{repo} {sum(ok)} of {len(ok)}")
    return ["summary: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())),
            (f"kernels: {sum(kernels.values())} of {len(kernels)} ran and matched ({', '.join(per_repo)}); "
             f"cases: {cases_ok} of {cases_run}")]


def main(argv=None, cases=None) -> int:
    """cases: the cases to run (default: all of scripts/aws_nki_cases.py and aws_nkilib_cases.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdk", type=Path, help="checkout of aws-neuron/aws-neuron-sdk")
    ap.add_argument("--nki-library", type=Path, help="checkout of aws-neuron/nki-library")
    ap.add_argument("-k", default="", help="run only cases whose name contains this string")
    args = ap.parse_args(argv)
    roots = {"sdk": args.sdk, "nki-library": args.nki_library}
    for key, root in roots.items():
        if root is not None and not root.is_dir():
            print(f"error: --{key} {root} is not a directory", file=sys.stderr)
            return 2
    if args.nki_library is not None:
        sys.path.insert(0, str(args.nki_library / "src" / "nkilib_src"))
    results = []
    for case in all_cases() if cases is None else cases:
        if args.k not in case.name:
            continue
        t0 = time.perf_counter()
        status, detail = run_case(case, roots)
        results.append((case, status))
        print(f"{status:5s} {case.name:55s} {time.perf_counter() - t0:6.1f}s {detail}", flush=True)
    for line in summarize(results):
        print(line)
    return 1 if any(status in ("FAIL", "ERROR") for _, status in results) else 0


if __name__ == "__main__":
    sys.exit(main())
