"""Benchmarks: named scenarios measured side by side with their baselines, in one process.

Run ``python -m bench --help`` from the repository root; see ``bench/README.md``.
"""
