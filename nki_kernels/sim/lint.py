"""Static check that kernel sources are Python the NKI 0.3-0.6 parser frontend accepts (NKI documentation).

The simulator runs any Python, so a kernel can pass simulation yet fail to compile (§7.1). This AST scan rejects
the constructs the parser is documented to reject: ``is`` / ``is not``, keyword-only ``*`` parameters, list-typed
kernel arguments (annotations or defaults; use tuples), and imports of anything but ``nki``, ``nki.language``,
``nki.isa``.
"""
from __future__ import annotations

import ast
from pathlib import Path

from . import real_api

ALLOWED_IMPORTS = frozenset({"nki", "nki.language", "nki.isa"})


def _function_problems(node) -> list[str]:
    out = []
    args = node.args
    if args.kwonlyargs:
        out.append(f"line {node.lineno}: keyword-only parameters ('*' separator) in {node.name}() are rejected; "
                   f"use ordinary parameters with defaults")
    for arg in args.posonlyargs + args.args + args.kwonlyargs:
        if arg.annotation is not None and "list" in ast.unparse(arg.annotation).lower():
            out.append(f"line {node.lineno}: parameter {arg.arg!r} of {node.name}() is list-typed; pass a tuple")
    for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
        if isinstance(default, (ast.List, ast.ListComp)):
            out.append(f"line {node.lineno}: a list default in {node.name}() is rejected; use a tuple")
    return out


def check_source(source: str, filename: str = "<kernel>") -> list[str]:
    """Return one message per construct the NKI 0.6 parser rejects (empty list = clean)."""
    tree = ast.parse(source, filename=filename)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            problems.append(f"line {node.lineno}: 'is' / 'is not' is rejected by the NKI parser; use == / !=")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems.extend(_function_problems(node))
        elif isinstance(node, ast.Import):
            problems.extend(f"line {node.lineno}: import {a.name} (kernel files may import only nki, nki.language, "
                            f"nki.isa)" for a in node.names if a.name not in ALLOWED_IMPORTS)
        elif isinstance(node, ast.ImportFrom) and (node.level or node.module not in ALLOWED_IMPORTS):
            problems.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import ... (kernel "
                            f"files may import only nki, nki.language, nki.isa)")
    return [f"{filename}: {p}" for p in problems] + real_api.check_source(source, filename)


def kernel_sources(package_root: Path) -> list[Path]:
    """Every ``kernel.py`` under the package plus every module under ``examples/``."""
    files = set(package_root.rglob("kernel.py")) | set((package_root / "examples").rglob("*.py"))
    return sorted(f for f in files if "sim" not in f.relative_to(package_root).parts[:1])


def check_file(path: Path) -> list[str]:
    return check_source(Path(path).read_text(), str(path))
