"""The benchmarks: ``python -m experiments.bench.<name>``; harness.py."""
