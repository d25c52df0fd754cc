"""Benchmarks: workloads, runners and reports."""
