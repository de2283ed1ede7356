"""Benchmarks, run from the repository root: `python -m benchmarks.<name>`."""
