"""Capacity planning for Neuron instances: which instance, TP degree and quantization fit a model, and the
memory, latency and throughput to expect (`neuron-infer plan`)."""
