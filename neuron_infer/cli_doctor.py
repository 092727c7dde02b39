"""`neuron-infer doctor`: whether this machine can compile `--target neuron`, and with which options.

Reads the installed Neuron SDK packages, the platform (instance type, torch-neuronx, or
NEURON_PLATFORM_TARGET_OVERRIDE) and the LNC degree, prints what the Neuron path supports here
(backends/neuron/support.py; the support matrix is in docs/neuron.md) and exits with one `error:` line (status 2)
when the combination is unsupported. `compile --target neuron` runs the same check before it traces.
"""
from __future__ import annotations

import json

import click

from neuron_infer.backends.neuron.support import machine_report
from neuron_infer.cli_help import examples
from neuron_infer.errors import BackendUnavailableError


def _import_torch_neuronx():
    """torch_neuronx when importable and not a placeholder, else None (the report then says it is missing)."""
    from neuron_infer.backends.neuron.graph import import_sdk

    try:
        return import_sdk()
    except BackendUnavailableError:
        return None


@click.command("doctor", epilog=examples("neuron-infer doctor",
                                         "neuron-infer doctor --kernels nki --tp-degree 8",
                                         "NEURON_PLATFORM_TARGET_OVERRIDE=trn1 neuron-infer doctor --json"))
@click.option("--kernels", type=click.Choice(["reference", "nki"]), default="reference", show_default=True,
              help="the --kernels the compile would use")
@click.option("--tp-degree", type=click.IntRange(min=1), default=1, show_default=True,
              help="the --tp-degree the compile would use (tp > 1 needs neuronx-distributed)")
@click.option("--lnc", type=click.Choice(["1", "2"]), default=None,
              help="the --lnc the compile would use (NEURON_LOGICAL_NC_CONFIG wins over it, as in a compile; default: the "
                   "platform's)")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
def doctor_cmd(kernels, tp_degree, lnc, as_json) -> None:
    """Check the Neuron SDK, platform and LNC of this machine against what --target neuron supports."""
    sdk = _import_torch_neuronx()
    report = machine_report(sdk, build_lnc=None if lnc is None else int(lnc), kernels=kernels, tp=tp_degree,
                            imported=("torch-neuronx",) if sdk is not None else ())
    click.echo(json.dumps(report.to_dict()) if as_json else "\n".join(report.lines()))
    report.raise_if_unsupported()
