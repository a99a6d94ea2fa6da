"""Bounded syncs as Dagster assets (the Dagster integration; these modules import ``dagster``).

:mod:`.declaration` a sync as declared; :mod:`.assets` the ``multi_asset`` and its translator;
:mod:`.metadata` a materialization's metadata and the bookmark read back from run storage;
:mod:`.partitions`, :mod:`.shards` one dynamic partition a shard of the source; :mod:`.schedules`;
:mod:`.launch_hint` what to do when Dagster's CLI refuses a partitioned asset without a partition.
"""
