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
