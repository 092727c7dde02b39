"""Which Neuron SDK each instance family needs for the Neuron path, and the check of this machine against it.

NOT YET RUN ON HARDWARE. The table is written from the Neuron SDK documentation (each fact names its page in
docs/neuron.md, "Support matrix"); the check reads the installed SDK packages (their distribution versions), the
platform (NEURON_PLATFORM_TARGET_OVERRIDE, else torch-neuronx's `utils.get_platform_target()`, else the EC2 instance
type in /sys/devices/virtual/dmi/id/product_name) and the LNC degree, and names every unsupported combination.
`neuron-infer doctor` prints the report; `compile --target neuron` runs the same check before it traces.

The Neuron path is torch-neuronx's XLA `trace` (tp 1) and neuronx-distributed's `ModelBuilder` (tp > 1):
* torch-neuronx 2.9.0.2.x is that XLA package (the same 2.9.0.2.15 build is listed in SDK 2.31, 2.32 and 2.33);
  torch-neuronx 2.13 / 2.14 (SDK 2.33) is the native TorchNeuron backend, which has no `trace`;
* neuronx-distributed 0.19 is NxD Core's last build (SDK 2.31); its inference APIs are in maintenance and end on
  Trn2/Trn3 with SDK 2.34 (they stay in maintenance at 2.31 on Inf2/Trn1);
* NKI kernels (`--kernels nki`) are documented for Trn2/Trn3 only; our kernels are valid NKI 0.6 (SDK 2.32) and
  0.7 (SDK 2.33).
Importing this module imports neither torch nor the SDK.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from neuron_infer.backends.neuron.platform import LNC_ENV, PLATFORM_ENV, PLATFORM_LNC, platform_target, resolve_target
from neuron_infer.errors import BackendUnavailableError

DISTRIBUTIONS = ("torch-neuronx", "neuronx-cc", "neuronx-distributed", "nki")
# neuronx-cc release -> Neuron SDK (component release notes of SDK 2.31, 2.32, 2.33)
COMPILER_SDK = {"2.26": "2.31", "2.27": "2.32", "2.28": "2.33"}
# NKI release -> Neuron SDK (NKI migration guide, "NKI version to Neuron SDK mapping")
NKI_SDK = {"0.5": "2.31", "0.6": "2.32", "0.7": "2.33"}
NKI_VALID = ("0.6", "0.7")  # the API tables our kernels are checked against (nki_kernels/sim/real_api.py)
DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")


@dataclass(frozen=True)
class FamilySupport:
    """What the Neuron path is written against on one instance family."""

    sdks: tuple[str, ...]  # Neuron SDK releases
    nki: bool  # whether --kernels nki applies
    lnc: tuple[int, ...]  # logical-NeuronCore degrees (first = default)


SUPPORT = {
    "inf2": FamilySupport(("2.31", "2.32", "2.33"), nki=False, lnc=(1,)),
    "trn1": FamilySupport(("2.31", "2.32", "2.33"), nki=False, lnc=(1,)),
    "trn2": FamilySupport(("2.31", "2.32", "2.33"), nki=True, lnc=(2, 1)),
    "trn3": FamilySupport(("2.31", "2.32", "2.33"), nki=True, lnc=(2, 1)),
}


@dataclass(frozen=True)
class SupportReport:
    platform: str | None
    platform_source: str
    instance_type: str | None
    lnc: int | None
    sdk: str | None
    versions: dict[str, str | None]
    compile_path: str
    kernels: str
    problems: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    def lines(self) -> list[str]:
        fam = SUPPORT.get(self.platform or "")
        out = [f"platform     {self.platform or 'unknown'} ({self.platform_source})",
               f"instance     {self.instance_type or 'unknown'}",
               f"lnc          {self.lnc if self.lnc is not None else 'unknown'}",
               "packages     " + ", ".join(f"{d} {v or 'not installed'}" for d, v in self.versions.items()),
               f"neuron sdk   {self.sdk or 'unknown'}"
               + (f" (this family: {', '.join(fam.sdks)})" if fam else ""),
               f"compile path {self.compile_path}",
               f"--kernels nki {'applies' if fam and fam.nki else 'does not apply'} on this platform"]
        out += [f"note         {n}" for n in self.notes]
        out.append("supported    " + ("yes" if not self.problems else "NO"))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"platform": self.platform, "platform_source": self.platform_source,
                "instance_type": self.instance_type, "lnc": self.lnc, "sdk": self.sdk, "versions": self.versions,
                "compile_path": self.compile_path, "kernels": self.kernels, "problems": list(self.problems),
                "notes": list(self.notes), "supported": not self.problems}

    def raise_if_unsupported(self) -> None:
        if self.problems:
            raise BackendUnavailableError("; ".join(self.problems) + " (docs/neuron.md, Support matrix)")


def installed_versions() -> dict[str, str | None]:
    """The installed version of each SDK distribution (None when absent), from the package metadata."""
    out: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def instance_type() -> str | None:
    """The EC2 instance type (e.g. trn1.32xlarge) from the DMI product name, None off EC2."""
    try:
        text = DMI_PRODUCT.read_text().strip()
    except OSError:
        return None
    return text if "." in text and text.split(".")[0][:3] in ("inf", "trn") else None


def family_of_instance(itype: str | None) -> str | None:
    if not itype:
        return None
    prefix = itype.split(".")[0].lower()
    for fam in ("inf2", "trn1", "trn2", "trn3"):
        if prefix.startswith(fam):
            return fam
    return None


def _minor(version: str | None, parts: int = 2) -> str | None:
    return None if version is None else ".".join(version.split("+")[0].split(".")[:parts])


def sdk_release(versions: dict[str, str | None]) -> str | None:
    """The Neuron SDK release the installed compiler (else NKI) comes from; 'newer than 2.33' / 'older than
    2.31' when outside the table."""
    for dist, table in (("neuronx-cc", COMPILER_SDK), ("nki", NKI_SDK)):
        v = _minor(versions.get(dist))
        if v is None:
            continue
        if v in table:
            return table[v]
        key = tuple(int(x) for x in v.split(".") if x.isdigit())
        newest, oldest = max(table, key=_key), min(table, key=_key)
        return f"newer than {table[newest]}" if key > _key(newest) else f"older than {table[oldest]}"
    return None


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _torch_neuronx_problems(v: str | None) -> list[str]:
    if v is None or v.startswith("unknown"):
        return []
    if not v.startswith("2.9.0.2."):
        return [(f"torch-neuronx {v} is not the XLA torch-neuronx 2.9.0.2.x whose trace() this path uses "
                 "(torch-neuronx 2.13/2.14 is the native TorchNeuron backend, torch.compile only)")]
    return []


def _sdk_problems(platform: str, sdk: str | None) -> list[str]:
    if sdk is None or sdk in SUPPORT[platform].sdks:
        return []
    if sdk.startswith("newer"):
        return [(f"Neuron SDK {sdk} is past what the Neuron path is written against on {platform} "
                 f"({', '.join(SUPPORT[platform].sdks)}); NxD Core inference ends on trn2/trn3 in 2.34")]
    return [(f"Neuron SDK {sdk} is older than the {', '.join(SUPPORT[platform].sdks)} the Neuron path is written "
             f"against on {platform}")]


def _kernel_problems(platform: str, kernels: str, nki: str | None) -> list[str]:
    if kernels != "nki":
        return []
    if not SUPPORT[platform].nki:
        return [(f"--kernels nki does not apply on {platform}: NKI is documented for trn2/trn3 only; use "
                 "--kernels reference")]
    if nki is not None and not nki.startswith("unknown") and _minor(nki) not in NKI_VALID:
        return [f"--kernels nki needs nki {' or '.join(NKI_VALID)} (Neuron SDK 2.32 / 2.33), installed: {nki}"]
    return []


def check(platform: str | None, platform_source: str, lnc: int | None, versions: dict[str, str | None], *,
          kernels: str = "reference", tp: int = 1, itype: str | None = None) -> SupportReport:
    """The report for one combination; every unsupported part is one entry of `problems`."""
    sdk = sdk_release(versions)
    path = ("torch_neuronx.trace (one NeuronCore)" if tp == 1
            else f"neuronx-distributed ModelBuilder ({tp} NeuronCores)")
    problems: list[str] = []
    notes: list[str] = []
    if versions.get("torch-neuronx") is None:
        problems.append("torch-neuronx is not installed (install the Neuron SDK from the Neuron pip repository)")
    problems += _torch_neuronx_problems(versions.get("torch-neuronx"))
    if tp > 1 and versions.get("neuronx-distributed") is None:
        problems.append(f"--tp-degree {tp} needs neuronx-distributed (0.19, Neuron SDK 2.31)")
    if platform is None:
        problems.append(f"no Neuron platform: not on an Inf2/Trn instance and {PLATFORM_ENV} is unset")
    else:
        fam = SUPPORT[platform]
        problems += _sdk_problems(platform, sdk)
        problems += _kernel_problems(platform, kernels, versions.get("nki"))
        if lnc is not None and lnc not in fam.lnc:
            problems.append(f"LNC {lnc} does not exist on {platform} (degrees: {', '.join(map(str, fam.lnc))})")
        inst = family_of_instance(itype)
        if inst is not None and inst != platform:
            notes.append(f"compiling on {itype} for {platform} ({platform_source})")
    if sdk == "2.33" and kernels == "nki":
        notes.append("NKI 0.7: the kernel LNC must equal neuronx-cc's --lnc (NCC_EVRF066); both are set from "
                     "the one resolved degree")
    return SupportReport(platform, platform_source, itype, lnc, sdk, dict(versions), path, kernels,
                         tuple(problems), tuple(notes))


def detect_platform(sdk: Any | None, itype: str | None) -> tuple[str | None, str]:
    """(platform, where it came from): the override variable or torch-neuronx (backends/neuron/platform.py's
    `platform_target`, the one a compile uses), else the instance type."""
    if os.environ.get(PLATFORM_ENV, "").strip():
        return platform_target(sdk), PLATFORM_ENV
    if sdk is not None:
        return platform_target(sdk), "torch_neuronx.utils.get_platform_target()"
    fam = family_of_instance(itype)
    return fam, ("instance type" if fam else "not detected")


def resolved_lnc(platform: str | None, build_lnc: int | None) -> int | None:
    """NEURON_LOGICAL_NC_CONFIG, then the build's lnc, then the platform default (backends/neuron/platform.py);
    an unparsable value is reported as is by the check rather than raised here."""
    env = os.environ.get(LNC_ENV, "").strip()
    if env:
        return int(env) if env.isdigit() else None
    if build_lnc is not None:
        return build_lnc
    return PLATFORM_LNC.get(platform or "")


def machine_report(sdk: Any | None, *, build_lnc: int | None = None, kernels: str = "reference", tp: int = 1,
                   imported: tuple[str, ...] = ()) -> SupportReport:
    """The report for this machine. `imported`: SDK distributions whose module this process already imported
    (their version is 'unknown' when the package has no metadata, e.g. a source install)."""
    itype = instance_type()
    platform, source = detect_platform(sdk, itype)
    versions = installed_versions()
    for dist in imported:
        if versions.get(dist) is None:
            versions[dist] = "unknown (no package metadata)"
    return check(platform, source, resolved_lnc(platform, build_lnc), versions, kernels=kernels, tp=tp, itype=itype)


def preflight(sdk: Any, build, tp: int = 1) -> None:
    """Before `compile --target neuron`: the same check as `neuron-infer doctor`, raised as one error (the LNC
    resolution's own errors first, as the compile would raise them)."""
    resolve_target(sdk, build.lnc)
    imported = ("torch-neuronx",) + (("neuronx-distributed",) if tp > 1 else ())
    machine_report(sdk, build_lnc=build.lnc, kernels=build.kernels, tp=tp, imported=imported).raise_if_unsupported()
