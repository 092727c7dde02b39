"""Checks in a new interpreter: one process per ISA level of the GEMV kernel libraries.

Libraries built for different ISA levels export the same C symbols (e.g. aoti_torch_cpu_ni_gemv_w8a8_v2), and a
process binds each symbol to the first library that defined it (they are loaded RTLD_GLOBAL). A graph's check
therefore runs in a process where its own library is the only one loaded, so it calls that library's code.
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
