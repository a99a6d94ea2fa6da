"""``faucet partitions refresh``: a partition for each new shard of every sharded sync of a code location."""

import argparse

from faucet_dagster.syncs.partitions import refresh_code_location


def refresh_command(args: argparse.Namespace) -> int:
    added = refresh_code_location(args.module, args.attribute, args.working_directory)
    for name, keys in added.items():
        print(f"{name}: added {len(keys)} partition(s): {', '.join(keys)}")
    if not added:
        print("no new shard")
    return 0


__all__ = ["refresh_command"]
