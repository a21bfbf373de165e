"""Benchmarks: each module runs with ``python -m bench.NAME`` from the repository root and prints JSON."""
