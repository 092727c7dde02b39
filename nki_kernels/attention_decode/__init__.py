"""Decode attention against a KV cache: kernel.py (NKI), reference.py (NumPy oracle), design.md."""
