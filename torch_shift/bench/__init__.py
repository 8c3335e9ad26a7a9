"""Benchmark tools: load generation and reports."""
