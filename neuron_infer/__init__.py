"""neuron-infer: compile Llama-family checkpoints into graphs (on a CPU one per phase, on Neuron one per bucket) and
generate from them.

Importing this package is cheap: torch, transformers and any Neuron SDK module are imported where they are used.
Python API: `neuron_infer.api` (compile_model, load, generate).
"""
__version__ = "0.1.6"
