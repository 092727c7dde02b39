"""Our kernels are valid NKI 0.6 (SDK 2.32) and NKI 0.7 (SDK 2.33): every nl.* / nisa.* name and keyword they use
is in both API tables (nki_kernels/sim/api_table.json and the 0.7 changes in api_table_0_7.json), they use no
construct 0.7 removed (nl.dynamic_range, while on a register), and their LNC degree, declared by the launch grid
the Neuron path uses (`jitted[lnc]`), equals the compiler's `--lnc` (0.7 rejects a difference: NCC_EVRF066)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nki_kernels
from neuron_infer.backends.neuron.platform import NeuronTarget
from neuron_infer.model.nki_neuron import Launcher
from nki_kernels.mx_matmul.kernel import mx_matmul_kernel
from nki_kernels.mx_matmul.reference import mx_matmul_reference, pack_mx_weight, pad_k
from nki_kernels.sim import SimulationError, real_api
from nki_kernels.sim.lint import kernel_sources

from .conftest import BF16

ROOT = Path(nki_kernels.__file__).parent
KERNELS = kernel_sources(ROOT)


@pytest.mark.parametrize("version", ["0.6", "0.7"])
@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kernel_is_valid_under_both_api_versions(path, version):
    assert real_api.check_source(path.read_text(), str(path), version=version) == []


def test_the_check_covers_our_op_kernels():
    rel = {p.relative_to(ROOT).as_posix() for p in KERNELS}
    assert {"attention_prefill/kernel.py", "attention_decode/kernel.py", "mlp/kernel.py",
            "mx_matmul/kernel.py"} <= rel


def _mx_case(rng):
    x = pad_k(rng.standard_normal((3, 512)).astype(BF16), axis=1)
    words, scales = pack_mx_weight((rng.standard_normal((512, 64)) / 16).astype(np.float32), "e4m3fn")
    return x, words, scales


@pytest.mark.parametrize("version", ["0.6", "0.7"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_launch_grid_matches_the_compiler_lnc(version, lnc, rng, monkeypatch):
    """The Neuron path launches kernels with the degree it compiles for; under 0.7 that passes neuronx-cc's LNC
    check (simulated from NEURON_CC_FLAGS), and the result still matches the reference."""
    import nki

    monkeypatch.setenv("NKI_SIMULATOR_API", version)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", " ".join(NeuronTarget("trn3", lnc).compiler_args()))
    x, words, scales = _mx_case(rng)
    out = Launcher(nki, lnc).launch(mx_matmul_kernel, x, words, scales).astype(np.float64)
    ref = mx_matmul_reference(x, words, scales, "e4m3fn").astype(np.float64)
    # same quantized operands: fp32 summation order and one bf16 output rounding (2^-9; 2^-8 allows a tie flip)
    np.testing.assert_allclose(out, ref, rtol=2.0 ** -8, atol=1e-5 * np.abs(ref).max())


def test_a_launch_grid_other_than_the_compiler_lnc_is_rejected_under_0_7(rng, monkeypatch):
    import nki

    monkeypatch.setenv("NKI_SIMULATOR_API", "0.7")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=2")
    with pytest.raises(SimulationError, match="NCC_EVRF066"):
        Launcher(nki, 1).launch(mx_matmul_kernel, *_mx_case(rng))
