"""Benchmarks comparing threadloader with other image loaders on the same data and method."""
