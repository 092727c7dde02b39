"""The public names of the real ``nki`` package and a check of kernel sources against them.

``api_table.json`` (next to this file) is derived from the NKI 0.6 API reference stubs of the Neuron SDK 2.32 (its
``source`` field names the files and commit): every public name of ``nki``, ``nki.language``, ``nki.isa`` and
``nki.collectives`` with its kind, the parameter names of functions and the members of classes/enums.
``api_table_0_7.json`` states NKI 0.7 (Neuron SDK 2.33) as changes to it, derived from the 2.33 API reference and
migration guide (its ``source`` field names the pages): names removed, added and deprecated.

``version``: "0.6", "0.7", or None for the union (what the simulator exposes, since it runs both).

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
TABLE_07_PATH = Path(__file__).with_name("api_table_0_7.json")
VERSIONS = ("0.6", "0.7")
# Documented submodules of the real package (they are modules, not names in the reference stubs' listings).
SUBMODULES = {"nki": {"language", "isa", "collectives", "simulator", "typing", "compiler", "dtype"},
              "nki.isa": {"constants"}}


@functools.lru_cache(maxsize=1)
def table() -> dict:
    return json.loads(TABLE_PATH.read_text())


@functools.lru_cache(maxsize=1)
def changes_07() -> dict:
    return json.loads(TABLE_07_PATH.read_text())


@functools.cache
def _module_names(module: str, version: str | None) -> dict:
    if version not in (None, *VERSIONS):
        raise ValueError(f"version must be one of {VERSIONS} or None, got {version!r}")
    base = dict(table()["modules"][module])
    if version == "0.6":
        return base
    added = changes_07()["added"].get(module, {})
    if version == "0.7":
        for name in changes_07()["removed"].get(module, {}):
            base.pop(name, None)
    return {**base, **added}


def names(module: str, version: str | None = None) -> dict:
    """``{name: entry}`` of one real module (``nki``, ``nki.language``, ``nki.isa``, ``nki.collectives``)."""
    return _module_names(module, version)


def params(module: str, name: str, version: str | None = None) -> list[str] | None:
    """Parameter names of a real function (None if ``name`` is not a function)."""
    entry = names(module, version).get(name)
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


def _label(version) -> str:
    return "the real NKI API" if version is None else f"the NKI {version} API"


def _check_attribute(node, mods, problems, version) -> None:
    hit = _resolve(node, mods)
    if hit is not None and hit[1] not in names(hit[0], version):
        problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]} is not in {_label(version)}")


def _check_member(node, mods, problems, version) -> None:
    """``nisa.dge_mode.hwdge``: the member must be one the real enum lists."""
    if not isinstance(node.value, ast.Attribute):
        return
    hit = _resolve(node.value, mods)
    if hit is None:
        return
    entry = names(hit[0], version).get(hit[1])
    if entry and entry["kind"] == "class" and entry["members"] and node.attr not in entry["members"] \
            and node.attr not in entry["methods"]:
        problems.append(f"line {node.lineno}: {hit[0]}.{hit[1]}.{node.attr} is not a member of the real enum")


def _check_call(node, mods, problems, version) -> None:
    hit = _resolve(node.func, mods)
    if hit is None:
        return
    ps = params(*hit, version)
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


def _register_names(tree, mods) -> set[str]:
    """Local names assigned from ``nisa.register_alloc(...)``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and _resolve(node.value.func, mods) == ("nki.isa", "register_alloc"):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def _check_register_while(tree, mods, problems, version) -> None:
    """``while reg:`` on a VirtualRegister: a runtime loop of 0.2-0.6, removed in 0.7 (use nl.while_loop)."""
    if version != "0.7":
        return
    regs = _register_names(tree, mods)
    for node in ast.walk(tree):
        if isinstance(node, ast.While) and isinstance(node.test, ast.Name) and node.test.id in regs:
            problems.append(f"line {node.lineno}: while on the VirtualRegister {node.test.id!r} was removed in "
                            f"NKI 0.7; use nl.while_loop")


def check_source(source: str, filename: str = "<kernel>", version: str | None = None) -> list[str]:
    """One message per use of a name / keyword / construct the ``nki`` API does not have (empty list = clean):
    ``version`` "0.6" or "0.7" checks against that API, None against either (a name of one of them)."""
    tree = ast.parse(source, filename=filename)
    mods, froms = _aliases(tree)
    problems: list[str] = []
    for lineno, module, name in froms:
        if module in table()["modules"] and name not in names(module, version) \
                and name not in SUBMODULES.get(module, ()):
            problems.append(f"line {lineno}: from {module} import {name}: not in {_label(version)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _check_attribute(node, mods, problems, version)
            _check_member(node, mods, problems, version)
        elif isinstance(node, ast.Call):
            _check_call(node, mods, problems, version)
    _check_register_while(tree, mods, problems, version)
    return [f"{filename}: {p}" for p in sorted(set(problems), key=lambda p: int(p.split()[1].rstrip(":")))]
