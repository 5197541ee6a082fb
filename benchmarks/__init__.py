"""Benchmarks for fot_jax (run as modules: python -m benchmarks.<name>)."""
