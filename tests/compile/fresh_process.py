"""Run a check in a new interpreter, for kernel libraries of one ISA level.

A process resolves a kernel's C symbol (e.g. aoti_torch_cpu_ni_gemv_w8a8_v1) to the first library that defined it
(they are loaded RTLD_GLOBAL), so a graph built for AVX2 in a process that already loaded the AVX-512 library
would run the AVX-512 code. Each ISA level's graphs are therefore checked in a process where their library is the
first and only one loaded.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(module: str, func: str, *args: str) -> None:
    """Call `module.func(*args)` in a new Python process; its assertion failures fail the calling test."""
    code = f"import sys\nfrom {module} import {func}\n{func}(*sys.argv[1:])\nprint('checked')"
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("checked"), done.stderr[-4000:]
