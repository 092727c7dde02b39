"""Every module imports (catches dead code that rots), and `import neuron_infer` stays cheap."""
import importlib
import pkgutil
import subprocess
import sys

import pytest

import neuron_infer
import nki_kernels

OPTIONAL = {"neuron_infer.vllm_plugin"}  # needs vLLM; tested in its own environment


def all_modules():
    for pkg in (neuron_infer, nki_kernels):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not any(info.name.startswith(o) for o in OPTIONAL):
                yield info.name


@pytest.mark.parametrize("name", sorted(all_modules()))
def test_module_imports(name):
    importlib.import_module(name)


def test_import_neuron_infer_does_not_import_torch_or_the_neuron_sdk():
    code = "import sys, neuron_infer, neuron_infer.cli; print(sorted(m for m in ('torch', 'torch_neuronx', 'nki', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _import_graph() -> dict[str, set[str]]:
    """module -> the neuron_infer modules it imports anywhere in its source (top level or inside functions)."""
    import ast
    from pathlib import Path

    root = Path(neuron_infer.__file__).parent
    mods = {".".join(("neuron_infer",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("neuron_infer"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("neuron_infer.")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str | None:
    """The package under neuron_infer/ a module belongs to (compile, runtime, ...), None for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def test_no_two_packages_import_each_other():
    """Packages form layers: if compile/ imports artifact/, artifact/ never imports compile/ (counting imports
    inside functions too: a lazy import only hides the dependency)."""
    edges: dict[tuple[str, str], str] = {}
    for m, deps in _import_graph().items():
        for d in deps:
            a, b = _package(m), _package(d)
            if a and b and a != b:
                edges.setdefault((a, b), f"{m} -> {d}")
    two_way = [f"{edges[(a, b)]} and {edges[(b, a)]}" for a, b in edges if (b, a) in edges and a < b]
    assert not two_way, two_way


def test_no_module_import_cycle():
    """No module imports itself through others, inside a package or across packages, lazy imports included."""
    assert _cycles(_import_graph()) == []


def test_packages_stay_in_their_layer():
    """compile/ writes an artifact and runtime/ reads it: neither imports the other, and the lower layers (model,
    quant, parallel, artifact, backends) import neither."""
    above = {"model": {"compile", "runtime", "artifact", "backends", "vllm_plugin"},
             "quant": {"compile", "runtime", "artifact", "backends", "vllm_plugin"},
             "parallel": {"compile", "runtime", "artifact", "backends", "vllm_plugin"},
             "artifact": {"compile", "runtime", "backends", "vllm_plugin"},
             "backends": {"compile", "runtime", "vllm_plugin"},
             "compile": {"runtime", "vllm_plugin"}, "runtime": {"compile", "vllm_plugin"}}
    bad = [f"{m} -> {d}" for m, deps in _import_graph().items() for d in deps
           if _package(d) in above.get(_package(m), set())]
    assert not bad, bad


def test_engines_are_built_only_in_runtime():
    """Engine, SpecEngine and NgramSpec objects are assembled by runtime/ (the loader) only."""
    import ast
    from pathlib import Path

    root = Path(neuron_infer.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        if path.parent.name == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Engine", "SpecEngine", "NgramSpec"):
                bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bad, bad


# An optional dependency is imported where it is used (the package runs without it). Two imports cost far more than
# torch and are deferred wherever they are used: transformers (tokenizers and the GGUF conversion only) and the
# symbolic-shapes module (it loads sympy; only an export needs it).
OPTIONAL_DEPENDENCIES = {"vllm", "nki", "xgrammar", "huggingface_hub", "torch_neuronx", "neuronx_distributed"}
DEFERRED_ANYWHERE = {"transformers", "torch.fx.experimental.symbolic_shapes"}
HEAVY = ("torch", "transformers", "safetensors.torch", "numpy", "jinja2", "tqdm")  # 0.03-1.2 s each to import


def _heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def _function_local_imports():
    """(module, line, imported module) of every import statement inside a function of neuron_infer."""
    import ast
    from pathlib import Path

    root = Path(neuron_infer.__file__).parent
    for path in sorted(root.rglob("*.py")):
        name = ".".join(("neuron_infer",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and node.module:
                        yield name, node.lineno, node.module
                    elif isinstance(node, ast.Import):
                        yield from ((name, node.lineno, a.name) for a in node.names)


def _imports_heavy_at_top(module: str, graph: dict[str, set[str]], seen: set[str] | None = None) -> bool:
    """Whether importing `module` imports torch or another HEAVY package (its top-level imports, transitively)."""
    import ast
    import importlib.util

    seen = set() if seen is None else seen
    if module in seen:
        return False
    seen.add(module)
    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(open(origin).read())
    tops = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    tops += [n.module + "." + a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
             for a in n.names] + [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
    if any(_heavy(t) for t in tops):
        return True
    ours = {t for t in tops if t in graph or t.startswith("nki_kernels")}
    return any(_imports_heavy_at_top(t, graph, seen) for t in ours if importlib.util.find_spec(t) is not None)


def test_function_local_imports_only_defer_heavy_or_optional_dependencies():
    """A function-local import keeps a light module light (`import neuron_infer` and the CLI never import torch)
    or imports an optional dependency where it is used. Anything else is imported at the top of the module: a lazy
    import inside a module that already imports torch defers nothing and only hides a dependency."""
    graph, bad = _import_graph(), []
    for module, line, target in _function_local_imports():
        if target.split(".")[0] in OPTIONAL_DEPENDENCIES or any(target.startswith(d) for d in DEFERRED_ANYWHERE):
            continue
        heavy_target = _heavy(target) or (
            target.split(".")[0] in ("neuron_infer", "nki_kernels") and _imports_heavy_at_top(target, graph))
        if _imports_heavy_at_top(module, graph) or not heavy_target:
            bad.append(f"{module}:{line} imports {target}")
    assert not bad, bad


def test_parallel_is_plan_sharding_collectives_and_launch_only():
    """parallel/ is used by compile/ and runtime/, never the reverse (compile <-> parallel had a cycle)."""
    graph = _import_graph()
    for m, deps in graph.items():
        if m.startswith("neuron_infer.parallel"):
            bad = {d for d in deps if d.split(".")[1] in ("compile", "runtime", "api", "vllm_plugin", "cli")}
            assert not bad, f"{m} imports {sorted(bad)}"
