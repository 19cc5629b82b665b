"""Benchmarks of every layer, each against its reference measured in the same run.

One module per suite; ``kvoffload bench`` runs them, and ``scripts/bench_*.py`` are thin
wrappers kept for muscle memory.
"""
