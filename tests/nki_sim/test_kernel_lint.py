"""Kernel sources must be valid NKI 0.6 parser input (no `is`, no keyword-only `*`, no list args, nki-only imports)."""
from __future__ import annotations

from pathlib import Path

import pytest

import nki_kernels
from nki_kernels.sim.lint import check_file, check_source, kernel_sources

ROOT = Path(nki_kernels.__file__).parent


def test_scan_finds_the_examples_and_every_kernel_py():
    files = kernel_sources(ROOT)
    names = {f.relative_to(ROOT).as_posix() for f in files}
    assert {"examples/gemm.py", "examples/mx_matmul.py", "examples/tensor_add.py"} <= names
    assert {f.relative_to(ROOT).as_posix() for f in ROOT.rglob("kernel.py")} <= names


@pytest.mark.parametrize("path", kernel_sources(ROOT), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kernel_source_is_nki_parser_clean(path):
    assert check_file(path) == []


@pytest.mark.parametrize("source,fragment", [
    ("def k(a):\n    if a is None:\n        pass\n", "'is' / 'is not'"),
    ("def k(a):\n    return a is not None\n", "'is' / 'is not'"),
    ("def k(a, *, b=1):\n    pass\n", "keyword-only parameters"),
    ("def k(a: list):\n    pass\n", "list-typed"),
    ("def k(a: tuple, b=[1, 2]):\n    pass\n", "list default"),
    ("import numpy as np\n", "import numpy"),
    ("from nki_kernels.sim import isa_data\n", "from nki_kernels.sim import"),
    ("from . import helpers\n", "from . import"),
])
def test_checker_rejects_each_construct(source, fragment):
    problems = check_source(source, "bad.py")
    assert len(problems) == 1 and fragment in problems[0]


def test_checker_accepts_plain_nki():
    src = ("import nki\nimport nki.isa as nisa\nimport nki.language as nl\nfrom nki.language import ds\n\n"
           "@nki.jit\ndef k(a, b=(1, 2), c=None):\n    if c == None:\n        return a\n    return b\n")
    assert check_source(src) == []
