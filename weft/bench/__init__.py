"""Benchmarks run by `weft bench ...`: weft and its reference side by side in one run."""
