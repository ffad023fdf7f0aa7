"""Topology validation for vLLM MLA serving: matrix -> servers -> workloads -> audit -> reports."""

__version__ = "0.1.0"
