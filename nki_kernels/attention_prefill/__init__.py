"""Causal GQA flash attention for prefill: kernel.py (NKI), reference.py (NumPy oracle), design.md."""
