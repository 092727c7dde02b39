"""The Neuron support check (`neuron-infer doctor`, and before `compile --target neuron`) for each instance family,
through the torch-neuronx recording double (its `utils.get_platform_target()` is the platform) and the installed
package versions of the Neuron SDK releases the matrix names (SDK 2.31/2.32/2.33 release artifacts). Not yet run on
hardware."""
import json
import sys

import pytest

from neuron_infer.backends.neuron import support as ns
from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV
from neuron_infer.cli import main
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig
from neuron_infer.errors import BackendUnavailableError
from tests.compile.neuron_doubles import RecordingNeuronSDK

XLA = "2.9.0.2.15.32035"   # torch-neuronx (XLA) in the SDK 2.31, 2.32 and 2.33 release artifacts
SDK = {
    "2.31": {"torch-neuronx": XLA, "neuronx-cc": "2.26.6360.0", "neuronx-distributed": "0.19.28492", "nki": "0.5.0"},
    "2.32": {"torch-neuronx": XLA, "neuronx-cc": "2.27.5334.0", "neuronx-distributed": "0.19.28492", "nki": "0.6.0"},
    "2.33": {"torch-neuronx": XLA, "neuronx-cc": "2.28.7631.0", "neuronx-distributed": "0.19.28492", "nki": "0.7.0"},
}


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """No platform variables, no EC2 instance type, no torch_neuronx unless a test installs the double."""
    for name in (LNC_ENV, PLATFORM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(ns, "instance_type", lambda: None)
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)


def on(monkeypatch, platform, versions):
    sdk = RecordingNeuronSDK(platform)
    monkeypatch.setitem(sys.modules, "torch_neuronx", sdk)
    monkeypatch.setattr(ns, "installed_versions", lambda: dict(versions))
    return sdk


def doctor(capsys, *args):
    """(exit status, stdout, stderr) of `neuron-infer doctor ARGS`."""
    try:
        main(["doctor", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("platform,sdk,args,lnc", [
    ("inf2", "2.31", ("--tp-degree", "8"), 1),
    ("trn1", "2.33", (), 1),
    ("trn2", "2.33", ("--kernels", "nki", "--tp-degree", "4"), 2),
    ("trn2", "2.31", (), 2),
    ("trn3", "2.32", ("--kernels", "nki", "--lnc", "1"), 1),
])
def test_supported_combinations_per_family(capsys, monkeypatch, platform, sdk, args, lnc):
    on(monkeypatch, platform, SDK[sdk])
    code, out, err = doctor(capsys, *args, "--json")
    report = json.loads(out)
    assert code == 0 and err == "" and report["supported"], report
    assert report["platform"] == platform and report["sdk"] == sdk and report["lnc"] == lnc
    assert report["platform_source"] == "torch_neuronx.utils.get_platform_target()"
    assert ("ModelBuilder" in report["compile_path"]) == ("--tp-degree" in args)


@pytest.mark.parametrize("platform,versions,args,fragment", [
    ("inf2", SDK["2.31"], ("--kernels", "nki"), "--kernels nki does not apply on inf2"),
    ("trn1", SDK["2.33"], ("--kernels", "nki"), "--kernels nki does not apply on trn1"),
    ("trn1", SDK["2.33"], ("--lnc", "2"), "LNC 2 does not exist on trn1"),
    ("trn2", SDK["2.31"], ("--kernels", "nki"), "needs nki 0.6 or 0.7 (Neuron SDK 2.32 / 2.33), installed: 0.5.0"),
    ("trn2", {**SDK["2.33"], "neuronx-cc": "2.29.100.0"}, (), "Neuron SDK newer than 2.33 is past"),
    ("trn3", {**SDK["2.33"], "neuronx-cc": "2.20.1.0"}, (), "Neuron SDK older than 2.31"),
    ("trn3", {**SDK["2.33"], "torch-neuronx": "2.14.3.0.1"}, (), "not the XLA torch-neuronx 2.9.0.2.x"),
    ("trn2", {**SDK["2.33"], "neuronx-distributed": None}, ("--tp-degree", "2"), "needs neuronx-distributed"),
])
def test_unsupported_combinations_are_one_error_line(capsys, monkeypatch, platform, versions, args, fragment):
    on(monkeypatch, platform, versions)
    code, out, err = doctor(capsys, *args)
    assert code == 2 and "supported    NO" in out
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err
    assert "Traceback" not in err


def test_without_the_sdk_the_platform_comes_from_the_instance_type(capsys, monkeypatch):
    monkeypatch.setattr(ns, "instance_type", lambda: "trn1n.32xlarge")
    monkeypatch.setattr(ns, "installed_versions", lambda: dict.fromkeys(ns.DISTRIBUTIONS))
    code, out, err = doctor(capsys, "--json")
    report = json.loads(out)
    assert report["platform"] == "trn1" and report["platform_source"] == "instance type" and report["lnc"] == 1
    assert code == 2 and "torch-neuronx is not installed" in err


def test_the_override_wins_and_cross_compiling_is_noted(capsys, monkeypatch):
    on(monkeypatch, "trn2", SDK["2.33"])
    monkeypatch.setattr(ns, "instance_type", lambda: "trn2.48xlarge")
    monkeypatch.setenv(PLATFORM_ENV, "inf2")
    code, out, _ = doctor(capsys)
    assert code == 0 and "platform     inf2 (NEURON_PLATFORM_TARGET_OVERRIDE)" in out
    assert "compiling on trn2.48xlarge for inf2" in out


def test_sdk_release_from_the_installed_packages():
    assert ns.sdk_release(SDK["2.32"]) == "2.32"
    assert ns.sdk_release({"neuronx-cc": None, "nki": "0.7.0"}) == "2.33"
    assert ns.sdk_release(dict.fromkeys(ns.DISTRIBUTIONS)) is None
    assert [ns.family_of_instance(t) for t in ("inf2.xlarge", "trn1n.32xlarge", "trn3.48xlarge", "c7i.large", None)] \
        == ["inf2", "trn1", "trn3", None, None]


BUILD = BuildConfig(target="neuron", dtype="fp32", max_context_length=32, max_length=64,
                    context_buckets=(16, 32), tokengen_buckets=(64,))


def test_compile_runs_the_check_before_tracing(monkeypatch, tiny_dirs, tmp_path):
    sdk = on(monkeypatch, "inf2", SDK["2.31"])
    with pytest.raises(BackendUnavailableError, match="--kernels nki does not apply on inf2"):
        compile_model(tiny_dirs("gqa"), tmp_path / "a", BUILD.replace(kernels="nki"), say=lambda m: None)
    assert sdk.calls == [] and not (tmp_path / "a").exists()


def test_the_lnc_variable_wins_over_the_option_as_in_a_compile(capsys, monkeypatch):
    on(monkeypatch, "trn1", SDK["2.33"])
    monkeypatch.setenv(LNC_ENV, "2")
    code, out, err = doctor(capsys, "--lnc", "1")
    assert code == 2 and "lnc          2" in out and "LNC 2 does not exist on trn1" in err
