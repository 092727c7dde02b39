"""Fused SwiGLU MLP (bf16/fp32 and FP8 weights): kernel.py (NKI), reference.py (NumPy oracle + packing), design.md."""
