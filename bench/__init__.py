"""Benchmarks (scripts; `bench.peers` is also a package: `python -m bench.peers`)."""
