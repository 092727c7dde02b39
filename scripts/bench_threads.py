"""Decode speed of `neuron-infer generate` with the default thread policy vs --threads 1 and 2, on an idle and
on a busy machine.

    python scripts/bench_threads.py ARTIFACT_DIR [--rounds 3] [--new-tokens 64] [--busy both|no|yes]

Each run is a fresh `generate --json --ignore-eos` process (the OpenMP settings are fixed when a process starts,
so this is what a user gets). The settings are interleaved in rounds; "busy" runs start one competing
CPU-bound process (`while True: pass`, nice 0) for their duration, then stop it. Every line carries the
1-minute load average read just before the run: on a shared machine the numbers move with it.
The ratio printed per round is default / max(--threads 1, --threads 2) of that round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": [], "threads 1": ["--threads", "1"], "threads 2": ["--threads", "2"]}
ROOT = Path(__file__).resolve().parents[1]


def run_generate(artifacts: str, extra: list[str], new_tokens: int) -> float:
    """Decode tokens/s of one generate process."""
    cmd = [sys.executable, "-m", "neuron_infer.cli", "generate", artifacts, "--prompt", "The capital of France is",
           "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json", *extra]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        print(f"error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        sys.exit(2)
    return json.loads(done.stdout)["metrics"]["tokens_per_s"]


def start_hog() -> subprocess.Popen:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)  # let it reach the scheduler's steady state
    return hog


def one_round(artifacts: str, busy: bool, new_tokens: int, shift: int) -> dict[str, tuple[float, float]]:
    """{setting: (tokens/s, load average before the run)} for every setting, the order rotated by `shift`."""
    names = list(SETTINGS)
    out = {}
    for name in names[shift % len(names):] + names[:shift % len(names)]:
        extra = SETTINGS[name]
        hog = start_hog() if busy else None
        try:
            load = os.getloadavg()[0]
            out[name] = (run_generate(artifacts, extra, new_tokens), load)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", help="a compiled artifact directory (batch 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--busy", choices=["both", "no", "yes"], default="both")
    args = ap.parse_args()
    if not Path(args.artifacts, "manifest.json").is_file():
        ap.error(f"{args.artifacts} is not a compiled artifact directory (no manifest.json)")
    modes = {"both": [False, True], "no": [False], "yes": [True]}[args.busy]
    ratios: dict[bool, list[float]] = {m: [] for m in modes}
    print(f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}, {args.new_tokens} new tokens")
    for r in range(args.rounds):
        for busy in modes:
            res = one_round(args.artifacts, busy, args.new_tokens, r)
            best = max(res["threads 1"][0], res["threads 2"][0])
            ratios[busy].append(res["default"][0] / best)
            cells = "  ".join(f"{k} {res[k][0]:6.1f} tok/s (load {res[k][1]:4.2f})" for k in SETTINGS)
            print(f"round {r + 1} {'busy' if busy else 'idle'}: {cells}  default/best {ratios[busy][-1]:.2f}",
                  flush=True)
    for busy, rs in ratios.items():
        print(f"{'busy' if busy else 'idle'}: default / best of (1, 2 threads): median {statistics.median(rs):.2f}, "
              f"range {min(rs):.2f}-{max(rs):.2f} over {len(rs)} rounds")


if __name__ == "__main__":
    main()
