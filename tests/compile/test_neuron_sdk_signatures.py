"""The recording doubles are held to the real Neuron SDK's signatures (tests/compile/neuron_sdk_signatures.py).

1. Every SDK call the package makes names an entry of the table (scanned from the source, so a new call without
   an entry fails here).
2. Every double refuses what the real function would: an unknown keyword, a missing required argument.
3. Every entry names the public source it was written from.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import neuron_infer
from tests.compile.neuron_doubles import RecordingNeuronSDK, RecordingNKI
from tests.compile.neuron_sdk_signatures import SIGNATURES, SDKContractError
from tests.parallel.nxd_double import NxDModel, RecordingNxD

PKG = Path(neuron_infer.__file__).parent
SDK_FILES = ("backends/neuron/graph.py", "backends/neuron/platform.py", "backends/neuron/tp.py", "model/nki_neuron.py")
MB = "neuronx_distributed.trace.model_builder"
# how the package spells each SDK handle -> the table's name for what it calls
CALL_SITES = {
    r"\bself\.sdk\.(\w+)\(": "torch_neuronx.{}",
    r"\bsdk\.utils\.(\w+)\(": "torch_neuronx.utils.{}",
    r"\bnxd\.trace\.model_builder\.(\w+)\b": MB + ".{}",
    r"\bbuilder\.(add|trace|shard_checkpoint)\(": MB + ".ModelBuilder.{}",
    r"\bnxd_model\.(\w+)\(": "neuronx_distributed.trace.spmd.NxDModel.{}",
    r"\bm\.(\w+_region)\b": "neuronx_distributed.parallel_layers.mappings.{}",
    r"\bself\._nki\.(\w+)\(": "nki.{}",
}


def test_every_sdk_call_in_the_package_has_a_real_signature_entry():
    text = "\n".join((PKG / f).read_text() for f in SDK_FILES)
    for pattern, name in CALL_SITES.items():
        found = set(re.findall(pattern, text))
        assert found, f"no call matches {pattern}: update CALL_SITES with the package's spelling"
        for call in found:
            assert name.format(call) in SIGNATURES, f"{name.format(call)} is called but has no signature entry"


def test_every_entry_names_its_public_source():
    for name, entry in SIGNATURES.items():
        assert re.search(r"\[(trace|replace)\.rst\]|\[nxdi?\]|\[nki\]", entry.source), name


def _doubles():
    sdk, nxd, nki = RecordingNeuronSDK(), RecordingNxD(1), RecordingNKI()
    mb = nxd.model_builder
    builder = mb.ModelBuilder(router=None, tp_degree=1, checkpoint_loader=dict)
    nxd_model = NxDModel(nxd, [], 1)
    ps, maps = nxd.parallel_layers.parallel_state, nxd.parallel_layers.mappings
    t = torch.zeros(1)
    return {  # table name -> (the double's callable, its required arguments)
        "torch_neuronx.trace": (sdk.trace, (lambda x: x, (t,))),
        "torch_neuronx.replace_weights": (sdk.replace_weights, (object(), {})),
        "torch_neuronx.move_trace_to_device": (sdk.move_trace_to_device, (object(), 0)),
        "torch_neuronx.utils.get_platform_target": (sdk.utils.get_platform_target, ()),
        f"{MB}.ModelBuilder": (mb.ModelBuilder, (None, 2, dict)),
        f"{MB}.ModelBuilder.add": (builder.add, ("k", None, [])),
        f"{MB}.ModelBuilder.trace": (builder.trace, ()),
        f"{MB}.BaseModelInstance": (mb.BaseModelInstance, (dict, {})),
        "neuronx_distributed.trace.spmd.NxDModel.initialize": (nxd_model.initialize, ([{}], t)),
        "neuronx_distributed.parallel_layers.parallel_state.get_tensor_model_parallel_rank":
            (ps.get_tensor_model_parallel_rank, ()),
        "neuronx_distributed.parallel_layers.mappings.reduce_from_tensor_model_parallel_region":
            (maps.reduce_from_tensor_model_parallel_region, (t,)),
        "neuronx_distributed.parallel_layers.mappings.gather_from_tensor_model_parallel_region":
            (maps.gather_from_tensor_model_parallel_region, (t,)),
        "nki.jit": (nki.jit, ()),
    }


def test_every_double_refuses_an_unknown_keyword_and_a_missing_argument():
    doubles = _doubles()
    for name, (fn, required) in doubles.items():
        if name != "nki.jit":  # jit(fn=None, **kwargs) takes any keyword
            with pytest.raises(SDKContractError, match="unexpected keyword"):
                fn(*required, not_a_parameter_of_the_sdk=1)
        if required:
            with pytest.raises(SDKContractError, match="missing a required argument"):
                fn(*required[:-1])


def test_a_double_sees_the_real_defaults():
    """parallel_model_trace inlines weights by default and ModelBuilder defaults to LNC 1: the doubles read the
    defaults from the table, never from their own parameter lists."""
    from tests.compile.neuron_sdk_signatures import bind

    assert bind("neuronx_distributed.trace.parallel_model_trace", lambda: None, ())["inline_weights_to_neff"] is True
    v = bind(f"{MB}.ModelBuilder", None, None, 2, dict)
    assert (v["logical_nc_config"], v["start_rank_id"], v["compiler_workdir"]) == (1, 0, None)
    assert bind("torch_neuronx.trace", None, (torch.zeros(1),))["inline_weights_to_neff"] is True
