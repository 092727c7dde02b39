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


def test_no_import_cycle_between_packages():
    """No import cycle crosses a package boundary (compile/, parallel/, runtime/, api, ...), counting imports inside
    functions too: a lazy import only hides a cycle. (Lazy registries inside one package are allowed.)"""
    for comp in _cycles(_import_graph()):
        packages = {m.split(".")[1] for m in comp}
        assert len(packages) == 1, f"import cycle across {sorted(packages)}: {sorted(comp)}"


def test_parallel_is_plan_sharding_collectives_and_launch_only():
    """parallel/ is used by compile/ and runtime/, never the reverse (compile <-> parallel had a cycle)."""
    graph = _import_graph()
    for m, deps in graph.items():
        if m.startswith("neuron_infer.parallel"):
            bad = {d for d in deps if d.split(".")[1] in ("compile", "runtime", "api", "vllm_plugin", "cli")}
            assert not bad, f"{m} imports {sorted(bad)}"
