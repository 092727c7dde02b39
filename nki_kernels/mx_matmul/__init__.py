"""MX matmul for trn3: kernel.py (NKI), reference.py (mx_golden oracle + host packing helpers), design.md."""
