"""Operators: each lives in its own package as kernels + reference + interface."""
