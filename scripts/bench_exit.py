#!/usr/bin/env python
"""Seconds from the last generated token to the process exit of `neuron-infer generate ARTIFACTS`.

Runs the command N times (stdout and stderr read as they arrive) and prints, per run, the time from the last byte
on stdout (the streamed answer's final newline) to the exit, with the load average; then the same for a bare
`python -c "import torch, transformers"` that prints one line, the floor of an interpreter exit with those
libraries loaded on this machine. Lower is better.

    python scripts/bench_exit.py artifacts/m --runs 5
"""
from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import time


def last_output_to_exit(cmd: list[str]) -> tuple[int, float, float]:
    """(exit status, total seconds, seconds from the last stdout byte to the exit) of one run of `cmd`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    last_out, open_streams = t0, 2
    while open_streams:
        for key, _ in sel.select():
            if not os.read(key.fileobj.fileno(), 65536):
                sel.unregister(key.fileobj)
                open_streams -= 1
            elif key.data == "out":
                last_out = time.perf_counter()
    proc.wait()
    end = time.perf_counter()
    return proc.returncode, end - t0, end - last_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", help="a compiled artifact directory (compiled once beforehand)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    generate = [sys.executable, "-m", "neuron_infer.cli", "generate", args.artifacts, "--prompt", "Hello",
                "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos"]
    bare = [sys.executable, "-c", "import torch, transformers; print('loaded')"]
    for name, cmd in (("generate", generate), ("bare import", bare)):
        for i in range(args.runs):
            code, total, tail = last_output_to_exit(cmd)
            print(f"{name} run {i}: exit {code}, total {total:.2f} s, last output -> exit {tail:.3f} s, "
                  f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
