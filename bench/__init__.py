"""Benchmarks: run as modules (python -m bench.<name>); they measure, they do not assert."""
