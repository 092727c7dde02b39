"""Kernels and the simulator use only the real NKI API (nki_kernels/sim/api_table.json, from the NKI 0.6 reference
stubs): every nl.* / nisa.* name our kernels use exists there with the keywords they pass, and every public name the
simulator exposes as nki, nki.language, nki.isa, nki.collectives is a real one (simulator-only helpers live in nki.simulator)."""
from __future__ import annotations

import enum
import importlib
import inspect
import types
from pathlib import Path

import pytest

import nki_kernels
from nki_kernels.sim import real_api
from nki_kernels.sim.lint import kernel_sources

ROOT = Path(nki_kernels.__file__).parent
KERNELS = kernel_sources(ROOT)


def test_table_names_its_source_and_has_the_four_modules():
    t = real_api.table()
    assert "NKI 0.6 API reference stubs" in t["source"] and "81ce03ae" in t["source"]
    assert set(t["modules"]) == {"nki", "nki.language", "nki.isa", "nki.collectives"}
    assert real_api.params("nki.isa", "dma_copy")[:2] == ["dst", "src"]
    assert "FP32_MIN" not in real_api.names("nki.language")


def test_every_kernel_source_is_scanned():
    rel = {p.relative_to(ROOT).as_posix() for p in KERNELS}
    assert "attention_prefill/kernel.py" in rel and "examples/causal_mask.py" in rel


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kernel_uses_only_real_names_and_keywords(path):
    assert real_api.check_source(path.read_text(), str(path)) == []


@pytest.mark.parametrize("source,fragment", [
    ("import nki.language as nl\nx = nl.FP32_MIN\n", "nki.language.FP32_MIN is not in the real NKI API"),
    ("import nki.isa as nisa\nnisa.dma_copy(dst=a, src=b, mask=c)\n", "has no parameter 'mask'"),
    ("import nki.isa as nisa\nnisa.tensor_copy(a, b, c, d, e)\n", "at most 4 positional"),
    ("import nki.isa as nisa\ne = nisa.engine.fast\n", "not a member of the real enum"),
    ("import nki\nnki.language.par_dim(128)\n", "nki.language.par_dim"),
    ("from nki.language import FP32_MIN\n", "from nki.language import FP32_MIN"),
])
def test_checker_reports_names_outside_the_api(source, fragment):
    problems = real_api.check_source(source, "k.py")
    assert len(problems) == 1 and fragment in problems[0], problems


def test_checker_accepts_real_calls():
    src = ("import nki\nimport nki.isa as nisa\nimport nki.language as nl\n"
           "t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf, name='t')\n"
           "nisa.dma_copy(dst=t, src=t, dge_mode=nisa.dge_mode.hwdge)\nnisa.activation(t, nl.exp, t, scale=2.0)\n"
           "k = nki.jit(f, anything=1)\n")
    assert real_api.check_source(src) == []


def _public(module):
    return [n for n in dir(module) if not n.startswith("_")]


MODULES = ["nki", "nki.language", "nki.isa", "nki.collectives"]


@pytest.mark.parametrize("modname", MODULES)
def test_simulator_exposes_only_real_names(modname):
    mod = importlib.import_module(modname)
    real = real_api.names(modname)
    extra = [n for n in _public(mod) if n not in real
             and not (isinstance(getattr(mod, n), types.ModuleType) and n in real_api.SUBMODULES.get(modname, ()))]
    assert extra == []


@pytest.mark.parametrize("modname", MODULES)
def test_simulator_functions_take_the_real_parameters(modname):
    mod = importlib.import_module(modname)
    wrong = {}
    for name, entry in real_api.names(modname).items():
        fn = vars(mod).get(name)
        if entry["kind"] != "function" or not inspect.isfunction(fn):
            continue   # nl.<op> operator objects take (x[, y], dtype=None) through __call__
        got = [("**" + p.name) if p.kind is p.VAR_KEYWORD else p.name for p in inspect.signature(fn).parameters.values()]
        if got != entry["params"]:
            wrong[name] = (got, entry["params"])
    assert wrong == {}


def test_collectives_are_complete_with_the_real_defaults():
    """Every public name of the real nki.collectives exists in the simulator, and each function's defaults are the
    ones the reference lists (priority=None, channel_ids=[0], ...)."""
    import nki.collectives as ncc
    real = real_api.names("nki.collectives")
    assert sorted(_public(ncc)) == sorted(real)
    wrong = {}
    for name, entry in real.items():
        if entry["kind"] != "function":
            continue
        got = {p.name: repr(p.default) for p in inspect.signature(getattr(ncc, name)).parameters.values()
               if p.default is not p.empty}
        if got != entry.get("defaults", {}):
            wrong[name] = (got, entry.get("defaults"))
    assert wrong == {}


def test_simulator_enums_have_the_real_members():
    import nki.isa as nisa
    for name, entry in real_api.names("nki.isa").items():
        if entry["kind"] == "class" and "Enum" in entry["bases"]:
            cls = getattr(nisa, name)
            assert issubclass(cls, enum.Enum) and [m.name for m in cls] == entry["members"], name


def test_prefill_kernel_masks_with_its_own_fp32_min():
    """nki.language has no FP32_MIN: the prefill kernel defines the most negative finite fp32 itself."""
    import nki.language as nl
    import numpy as np

    from nki_kernels.attention_prefill import kernel as prefill

    assert prefill.FP32_MIN == float(np.finfo(np.float32).min)
    assert not hasattr(nl, "FP32_MIN")
