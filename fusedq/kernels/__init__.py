"""Kernel backends, one module each (Triton first)."""
