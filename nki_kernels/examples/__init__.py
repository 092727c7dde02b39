"""Canonical NKI example kernels (new ``nki`` API, NKI 0.6/0.7). Each file imports only nki / nl / nisa and runs
unchanged on a NeuronCore (not yet run on hardware) and on the simulator in nki_kernels/sim."""
