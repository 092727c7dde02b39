"""The public names of the real ``nki`` package and a check of kernel sources against them.

``api_table.json`` (next to this file) is derived from the NKI 0.6 API reference stubs of the Neuron SDK (its
``source`` field names the files and commit): every public name of ``nki``, ``nki.language``, ``nki.isa`` and
``nki.collectives`` with its kind, the parameter names of functions and the members of classes/enums.

``check_source`` walks a kernel file's AST and reports every ``nl.*`` / ``nisa.*`` / ``nki.*`` name that is not in
the real API, and every keyword argument that is not a parameter of the called function, so a kernel that runs on
the simulator cannot use a name only the simulator has.
"""
from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("api_table.json")
# Documented submodules of the real package (they are modules, not names in the reference stubs' listings).
SUBMODULES = {"nki": {"language", "isa", "collectives", "simulator", "typing", "compiler", "dtype"},
              "nki.isa": {"constants"}}


@functools.lru_cache(maxsize=1)
def table() -> dict:
    return json.loads(TABLE_PATH.read_text())


def names(module: str) -> dict:
    """``{name: entry}`` of one real module (``nki``, ``nki.language``, ``nki.isa``, ``nki.collectives``)."""
    return table()["modules"][module]


def params(module: str, name: str) -> list[str] | None:
    """Parameter names of a real function (None if ``name`` is not a function)."""
    entry = names(module).get(name)
    return entry["params"] if entry and entry["kind"] == "function" else None


def _aliases(tree) -> tuple[dict, list]:
    """Local names bound to real modules (``nl`` -> ``nki.language``) and ``from nki.x import y`` bindings."""
    mods, froms = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "nki" or a.name.startswith("nki."):
                    mods[a.asname or a.name.split(".")[0]] = a.name if a.asname else "nki"
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith("nki."):
            for a in node.names:
                froms.append((node.lineno, node.module, a.name))
                if a.name in SUBMODULES.get(node.module, ()):
                    mods[a.asname or a.name] = f"{node.module}.{a.name}"
    return mods, froms


def _resolve(node, mods) -> tuple[str, str] | None:
    """``nl.exp`` -> ("nki.language", "exp"); ``nki.language.exp`` -> same; ``nisa.engine`` -> ("nki.isa", "engine")."""
    if not isinstance(node, ast.Attribute):
        return None
    parts = []
    cur = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    if not isinstance(cur, ast.Name) or cur.id not in mods:
        return None
    module, parts = mods[cur.id], parts[::-1]
    while parts and parts[0] in SUBMODULES.get(module, ()):
        module = f"{module}.{parts.pop(0)}"
    if not parts or module not in table()["modules"]:
        return None
    return module, parts[0]


def _check_attribute(node, mods, problems) -> None:
    hit = _resolve(node, mods)
    if hit is not None and hit[1] not in names(hit[0]):
        problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]} is not in the real NKI API")


def _check_member(node, mods, problems) -> None:
    """``nisa.dge_mode.hwdge``: the member must be one the real enum lists."""
    if not isinstance(node.value, ast.Attribute):
        return
    hit = _resolve(node.value, mods)
    if hit is None:
        return
    entry = names(hit[0]).get(hit[1])
    if entry and entry["kind"] == "class" and entry["members"] and node.attr not in entry["members"] \
            and node.attr not in entry["methods"]:
        problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]}.{node.attr} is not a member of the real enum")


def _check_call(node, mods, problems) -> None:
    hit = _resolve(node.func, mods)
    if hit is None:
        return
    ps = params(*hit)
    if ps is None:
        return
    if any(p.startswith("**") for p in ps):
        return
    for kw in node.keywords:
        if kw.arg is not None and kw.arg not in ps:
            problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]}() has no parameter {kw.arg!r} "
                            f"(real parameters: {', '.join(ps)})")
    if not any(isinstance(a, ast.Starred) for a in node.args) and len(node.args) > len(ps):
        problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]}() takes at most {len(ps)} positional arguments")


def check_source(source: str, filename: str = "<kernel>") -> list[str]:
    """One message per use of a name / keyword the real ``nki`` API does not have (empty list = clean)."""
    tree = ast.parse(source, filename=filename)
    mods, froms = _aliases(tree)
    problems: list[str] = []
    for lineno, module, name in froms:
        if module in table()["modules"] and name not in names(module) and name not in SUBMODULES.get(module, ()):
            problems.append(f"line {lineno}: from {module} import {name}: not in the real NKI API")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _check_attribute(node, mods, problems)
            _check_member(node, mods, problems)
        elif isinstance(node, ast.Call):
            _check_call(node, mods, problems)
    return [f"{filename}: {p}" for p in sorted(set(problems), key=lambda p: int(p.split()[1].rstrip(":")))]
