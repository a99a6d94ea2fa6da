"""Hostile identifiers: names a destination must keep exactly, or refuse, and never change.

Every scenario names its resources and the columns it adds with these: SQL keywords, mixed case,
spaces and quotes, non-ASCII letters, names of exactly 63 bytes (PostgreSQL's limit, which it enforces
by silently truncating anything longer), which must land, and a column of 64 bytes, which may be
refused. A destination keeps each name as given (quoting it), or refuses the one past its limit with
a FaucetError; a name that lands folded, truncated or renamed loses the data written under it to
readers who use the name.
"""

import random

POSTGRES_LIMIT = 63


def _bytes(text: str) -> int:
    return len(text.encode())


def exactly(prefix: str, size: int = POSTGRES_LIMIT, fill: str = "x") -> str:
    """``prefix`` padded with ``fill`` to exactly ``size`` bytes of UTF-8."""
    name = prefix
    while _bytes(name + fill) <= size:
        name += fill
    while _bytes(name) < size:
        name += "x"
    return name


RESOURCES: tuple[str, ...] = (
    "order",
    "MixedCase",
    "ünïcødé_表",
    "with space",
    exactly("long_resource_"),
    "Select",
    "it's",
    exactly("é_", fill="é"),
)
"""Resource (table) names, each a different hostility; all at most 63 bytes."""

COLUMNS: tuple[str, ...] = (
    "select",
    "CamelColumn",
    "naïve_列",
    "two words",
    exactly("c_"),
    'quote"d',
    "from",
    exactly("ü_", fill="ü"),
)
"""Column names added by schema evolution; all at most 63 bytes."""


TOO_LONG = exactly("ü", 64, fill="ü")
"""A column name of 64 bytes (32 characters): past PostgreSQL's limit, so a destination with that
limit refuses it, and one without keeps it; none may truncate it."""


def resources(rng: random.Random, count: int) -> list[str]:
    """``count`` different resource names, in an order drawn from ``rng``."""
    names = list(RESOURCES)
    rng.shuffle(names)
    return names[:count]


def columns(rng: random.Random, count: int) -> list[str]:
    """``count`` column names in an order drawn from ``rng``; the first is always :data:`TOO_LONG`."""
    names = list(COLUMNS)
    rng.shuffle(names)
    return [TOO_LONG, *names[: count - 1]]


__all__ = ["COLUMNS", "POSTGRES_LIMIT", "RESOURCES", "TOO_LONG", "columns", "exactly", "resources"]
