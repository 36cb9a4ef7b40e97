"""Benchmarks: each runs the alternatives side by side in one run and reports ratios."""
