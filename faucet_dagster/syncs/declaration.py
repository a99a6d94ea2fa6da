"""A bounded sync as declared: its endpoints, delivery, batch size and dead-letter route; no Dagster
definitions are built here (:mod:`.assets` builds them)."""

from dataclasses import dataclass

from faucet_dagster.declarations.preflight import PairCheck, build_offline
from faucet_dagster.declarations.resources import FaucetEndpoint
from faucet_dagster.protocol import Delivery, Mode, Role, Source
from faucet_dagster.runner.bounded_values import DEFAULT_BATCH_SIZE, SyncSettings
from faucet_dagster.runner.sync import run_sync


@dataclass(frozen=True)
class FaucetSync:
    """One bounded sync: read ``source`` and write ``sink`` with the mode its config chooses.

    ``delivery`` is the guarantee asked for (``None``: the best reachable; the plan says which).
    ``dead_letter`` receives the rows that cannot be converted or that the sink rejects (it rules out
    the atomic watermark). ``evolve_schema`` adds new source columns to the destination instead of
    failing the run.
    """

    name: str
    source: FaucetEndpoint
    sink: FaucetEndpoint
    delivery: Delivery | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    evolve_schema: bool = False
    dead_letter: FaucetEndpoint | None = None
    description: str | None = None

    def settings(self) -> SyncSettings:
        """The runner settings of this sync (run storage is durable state)."""
        return SyncSettings(
            delivery=self.delivery,
            batch_size=self.batch_size,
            evolve_schema=self.evolve_schema,
            durable_state=True,
        )

    def pair_check(self) -> PairCheck:
        """What the definitions' load checks of this sync (:mod:`faucet_dagster.declarations.preflight`)."""
        return PairCheck(
            where=f"sync {self.name}",
            mode=Mode.BOUNDED,
            source=self.source,
            sink=self.sink,
            delivery=self.delivery,
            dead_letter=self.dead_letter,
        )

    def shardable(self) -> bool:
        """Whether the source is known now and declares itself shardable (no I/O: capabilities
        come from the config, environment references unread; a source that cannot be built without
        their values is not known now)."""
        source, _ = build_offline(self.source, Role.SOURCE)
        if not isinstance(source, Source):
            return False
        try:
            return source.capabilities().shardable
        finally:
            run_sync(source.close())

    def endpoints(self) -> tuple[FaucetEndpoint, ...]:
        return (
            (self.source, self.sink)
            if self.dead_letter is None
            else (self.source, self.sink, self.dead_letter)
        )


@dataclass(frozen=True)
class FaucetSyncData:
    """What a translator sees of a sync: the declaration and whether its asset is partitioned (one
    dynamic partition a shard of its source)."""

    sync: FaucetSync
    partitioned: bool = False


def op_name(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return f"faucet_{cleaned}"


def partitions_def_name(sync: FaucetSync) -> str:
    """The name of the dynamic partitions of ``sync``'s asset: ``faucet_<sync>_shards``."""
    return f"{op_name(sync.name)}_shards"


__all__ = ["FaucetSync", "FaucetSyncData", "op_name", "partitions_def_name"]
