"""Shards of a source as partition keys: short, stable names for Dagster partitions (no Dagster here).

A shard is what a shardable source reads independently (a file, ``topic/partition``). Its partition
key is its path relative to the shards' common directory; a run maps its key back to a shard among
those the source lists then (:func:`shard_of`).
"""

import os
from collections.abc import Sequence

from faucet_dagster.protocol import Source


async def list_shards(source: Source) -> Sequence[str]:
    """The shards of ``source`` (I/O: a run or a partitions sensor, never the definitions' load)."""
    try:
        return await source.enumerate_shards()
    finally:
        await source.close()


def shard_partitions(shards: Sequence[str]) -> dict[str, str]:
    """Partition key -> shard for ``shards`` (see :func:`partition_keys`)."""
    return dict(zip(partition_keys(shards), shards, strict=True))


def shard_of(partition: str, shards: Sequence[str]) -> str | None:
    """The shard a partition key names among ``shards``: by the keys these shards map to, else the
    one shard that is the key or ends with ``/<key>`` (a key added when the shards were fewer and
    their common directory deeper)."""
    found = shard_partitions(shards).get(partition)
    if found is not None:
        return found
    matches = [shard for shard in shards if shard == partition or shard.endswith("/" + partition)]
    return matches[0] if len(matches) == 1 else None


def partition_keys(shards: Sequence[str]) -> list[str]:
    """Each shard relative to the shards' common directory (a file name, for files in one folder).

    Shards that do not share a directory, or whose relative names collide, keep their full names.
    """
    if len(shards) == 1:
        return [os.path.basename(shards[0]) or shards[0]]
    try:
        common = os.path.commonpath(shards) if shards else ""
    except ValueError:  # absolute and relative paths mixed: no common directory
        common = ""
    keys = [os.path.relpath(shard, common) if common else shard for shard in shards]
    return keys if len(set(keys)) == len(keys) else list(shards)


__all__ = ["list_shards", "shard_of", "shard_partitions"]
