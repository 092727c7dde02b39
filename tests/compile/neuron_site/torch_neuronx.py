"""`import torch_neuronx` for a process of a test: the recording double (tests/compile/neuron_doubles.py) as an
installed module file, so compile worker processes import it as they would the real SDK.

A test puts this directory on PYTHONPATH (and on sys.path). Every `trace` call, still bound against the real
signature first, is also appended as one JSON line ({"pid", "shapes", "args"}) to the file named by
NEURON_DOUBLE_LOG, so the test sees the calls of every process.
"""
import json
import os
import sys

from tests.compile.neuron_doubles import RecordingNeuronSDK


class LoggingNeuronSDK(RecordingNeuronSDK):
    def _trace(self, func, example_inputs, input_output_aliases, compiler_workdir, compiler_args,
               partitioner_config, inline_weights_to_neff, cpu_backend):
        graph = super()._trace(func, example_inputs, input_output_aliases, compiler_workdir, compiler_args,
                               partitioner_config, inline_weights_to_neff, cpu_backend)
        with open(os.environ["NEURON_DOUBLE_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "shapes": [list(t.shape) for t in example_inputs],
                                "args": compiler_args}) + "\n")
        return graph


_sdk = LoggingNeuronSDK(os.environ.get("NEURON_DOUBLE_PLATFORM", "trn2"))
_sdk.__file__ = __file__  # an installed module (compile/neuron_workers.py sends misses to workers only then)
sys.modules[__name__] = _sdk
