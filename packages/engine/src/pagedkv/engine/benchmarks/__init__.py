"""Benchmarks behind `pagedkv bench ...`: each prints a table and ends with one JSON line."""
