"""Scenario modules. Every module in this package is imported by :func:`load_all`; each registers its
scenarios with :func:`bench.registry.scenario` at import time."""

import importlib
import pkgutil


def load_all() -> None:
    """Import every module of this package (registering their scenarios). Idempotent."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        importlib.import_module(f"{__name__}.{info.name}")
