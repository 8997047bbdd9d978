"""Benchmarks (not tests): `python -m tests.perf.bench`."""
