"""A bounded sync as declared: its endpoints, delivery, batch size, dead-letter route, retries, pool,
opt-in checks and partitions; no Dagster definitions are built here (:mod:`.assets` builds them)."""

from dataclasses import dataclass, replace

import dagster as dg

from faucet_dagster.declarations.preflight import PairCheck, build_offline
from faucet_dagster.declarations.resources import FaucetEndpoint
from faucet_dagster.protocol import ConfigError, Delivery, Mode, Role, Source
from faucet_dagster.runner.bounded_values import DEFAULT_BATCH_SIZE, SyncSettings
from faucet_dagster.runner.sync import run_sync

DEFAULT_RETRY_POLICY = dg.RetryPolicy(
    max_retries=3, delay=5, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
)
"""Retryable errors: retried 3 times, after about 5, 15 and 35 seconds."""


@dataclass(frozen=True)
class SyncChecks:
    """Asset checks a sync opts in to, each evaluated after every run (in the run).

    ``no_dead_letters``: fails when the run dead-lettered rows. ``row_count_drop``: fails when the
    destination table has fewer rows than after the previous run by more than this fraction (0: any
    drop; a table a sync appends to never shrinks unless something else deletes). ``bookmark_advances``:
    warns when the run found nothing new (its bookmark did not move: a source that stopped growing).
    """

    no_dead_letters: bool = False
    row_count_drop: float | None = None
    bookmark_advances: bool = False

    def __post_init__(self) -> None:
        if self.row_count_drop is not None and not 0 <= self.row_count_drop < 1:
            raise ConfigError(
                f"row_count_drop is a fraction from 0 to 1 (excluded), not {self.row_count_drop}",
                where="checks.row_count_drop",
            )

    @property
    def any(self) -> bool:
        return self.no_dead_letters or self.row_count_drop is not None or self.bookmark_advances


@dataclass(frozen=True)
class FaucetSync:
    """One bounded sync: read ``source`` and write ``sink`` with the mode its config chooses.

    ``delivery`` is the guarantee asked for (``None``: the best reachable; the plan says which).
    ``dead_letter`` receives the rows that cannot be converted or that the sink rejects (it rules out
    the atomic watermark). ``evolve_schema`` adds new source columns to the destination instead of
    failing the run. ``retry_policy`` (default :data:`DEFAULT_RETRY_POLICY`) retries a run that failed
    on a retryable error, ``pool`` limits concurrent runs, ``checks`` opts in to asset checks
    (:class:`SyncChecks`), ``time_partitions`` partitions a time-cursor source by time windows.
    """

    name: str
    source: FaucetEndpoint
    sink: FaucetEndpoint
    delivery: Delivery | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    evolve_schema: bool = False
    dead_letter: FaucetEndpoint | None = None
    description: str | None = None
    retry_policy: dg.RetryPolicy | None = DEFAULT_RETRY_POLICY
    """How a run that fails on a retryable error (a refused connection, a server gone away) is
    retried; None: never. Errors that are not retryable (configuration, schema, data) fail at once."""
    pool: str | None = None
    """Dagster's concurrency pool the sync's runs take a slot of (``dg.instance`` pools: limit how many
    syncs hit one database at a time)."""
    checks: SyncChecks = SyncChecks()
    time_partitions: dg.TimeWindowPartitionsDefinition | None = None
    """One partition per time window of a source that reads by a time cursor (the ``sql`` connector
    with ``cursor`` a timestamp column): each run reads ``window start <= cursor < window end``, from
    its partition's own bookmark."""

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
        source = self.source
        if self.time_partitions is not None:  # each run reads one window: the source must take it
            window = self.time_partitions.get_first_partition_window()
            if window is not None:
                bounds = {"start": window.start.isoformat(), "end": window.end.isoformat()}
                source = replace(source, config={**source.config, "cursor_window": bounds})
        return PairCheck(
            where=f"sync {self.name}",
            mode=Mode.BOUNDED,
            source=source,
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


__all__ = [
    "DEFAULT_RETRY_POLICY",
    "FaucetSync",
    "FaucetSyncData",
    "SyncChecks",
    "op_name",
    "partitions_def_name",
]
