"""What to do when Dagster's CLI is asked to run a partitioned sync without a partition.

``dg launch --assets orders`` and ``dagster asset materialize --select orders`` refuse a partitioned
asset without ``--partition`` in Dagster's own CLI, before any faucet code runs, with a
``CheckError`` traceback. The CLI loads the definitions in its own process first, so a faucet
definition holding a partitioned sync installs :func:`install_launch_hint`: that one uncaught
error, and only it, is printed as a message naming the partitioned syncs and the commands that run
them (the exit status stays 1). Any other uncaught exception goes to the hook that was there before.
"""

import sys
import threading
from types import TracebackType

from dagster_shared.check import CheckError

DAGSTER_REFUSAL = "Asset has partitions, but no '--partition' option was provided"
"""The text of the ``CheckError`` Dagster's CLI raises (dagster/_cli/asset.py)."""

_partitioned: dict[str, None] = {}
_lock = threading.Lock()


def install_launch_hint(sync_name: str) -> None:
    """Explain Dagster's refusal to launch partitioned ``sync_name`` without a partition (once a process)."""
    with _lock:
        if not _partitioned:
            previous = sys.excepthook

            def hint(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
                if isinstance(value, CheckError) and DAGSTER_REFUSAL in str(value):
                    print(launch_hint(), file=sys.stderr)
                    return
                previous(kind, value, tb)

            sys.excepthook = hint
        _partitioned[sync_name] = None


def launch_hint() -> str:
    """The message printed instead of Dagster's traceback."""
    names = ", ".join(_partitioned)
    first = next(iter(_partitioned), "SYNC")
    return (
        f"error: a partitioned faucet sync needs a partition ({names}: one partition a shard of the "
        "source, each with its own bookmark). Run one with "
        f"`dg launch --assets {first} --partition KEY`, several with "
        f"`dg launch --assets {first} --partition-range FIRST...LAST` (one run moving each partition "
        "from its own bookmark), or every partition with a backfill (the UI's Materialize all) or the "
        "sync's schedule. The keys are in the UI's Partitions tab; `faucet partitions refresh -m "
        "MODULE` adds the shards that are new."
    )


__all__ = ["DAGSTER_REFUSAL", "install_launch_hint", "launch_hint"]
