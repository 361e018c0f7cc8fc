"""Benchmarks (installed as hyspec_jax.bench)."""
