"""Benchmarks run by `dz bench ...`; their results go to docs/performance.md."""
