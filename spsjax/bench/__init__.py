"""Benchmarks: decode timing, memory bandwidth and the bytes a decode step must read."""
