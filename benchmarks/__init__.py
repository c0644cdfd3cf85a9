"""Benchmarks: loop overhead, speed, and the real-pair evaluation."""
