"""The Delta Lake sink on real Delta tables (delta-rs): local folders, and S3 (moto's server on loopback).

Tests marked with the ``lake`` fixture run on both stores. Faults are injected at exact points: a child
process that dies (``os._exit``) right before, or right after, a page's Delta commit; a snapshot of the
table read before another writer committed the same transaction identifier (what a second process does
between this writer's read and its commit). On S3 that second commit is refused by the store itself: the
log entry is written with ``If-None-Match: *``, and the endpoint answers 412 because the first writer
created it.
"""

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from faucet_delta.config import S3Storage
from faucet_delta.sink import DeltaSink

from faucet_dagster.protocol import (
    AuthError,
    CommitConflict,
    CommitToken,
    ConfigError,
    ConnectionFailed,
    DataError,
    FaucetError,
    Role,
    SchemaError,
    Sink,
    UnsupportedOperation,
    WritePolicy,
    get_connector,
)
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import BoundedSyncResult, PageReport, SyncSettings
from faucet_dagster.testing import S3Server


@dataclass(frozen=True)
class Lake:
    """Where a test's tables live: a local folder, or a bucket on the session's S3 endpoint."""

    root: str
    s3: dict[str, Any] | None = None

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def config(self, name: str, **config: Any) -> dict[str, Any]:
        return {"uri": self.uri(name), **({} if self.s3 is None else {"s3": self.s3}), **config}

    def options(self) -> dict[str, str] | None:
        return None if self.s3 is None else S3Storage.model_validate(self.s3).storage_options()

    def table(self, name: str) -> DeltaTable:
        return DeltaTable(self.uri(name), storage_options=self.options())

    def rows(self, name: str, *columns: str) -> list[tuple[Any, ...]]:
        table = self.table(name).to_pyarrow_table(columns=list(columns) or None)
        return sorted(tuple(row.values()) for row in table.to_pylist())

    def sink(self, name: str, **config: Any) -> Sink:
        return get_connector("delta").sink(self.config(name, **config))


def s3_lake(server: S3Server, bucket: str) -> Lake:
    return Lake(
        f"s3://{bucket}/lake",
        {
            "endpoint_url": server.endpoint_url,
            "region": server.region,
            "access_key_id": server.access_key_id,
            "secret_access_key": server.secret_access_key,
            "allow_http": server.endpoint_url.startswith("http://"),
        },
    )


@pytest.fixture(params=["local", "s3"])
def lake(request: pytest.FixtureRequest, tmp_path: Path) -> Lake:
    if request.param == "local":
        return Lake(str(tmp_path / "lake"))
    return s3_lake(request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def orders(ids: Sequence[int], version: int = 1, **extra: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}v{version}", **extra} for i in ids])


def sink(path: Path, **config: Any) -> Sink:
    return get_connector("delta").sink({"uri": str(path), **config})


async def write(target: Sink, *batches: pa.RecordBatch, token: int | None = None, finish: bool = True) -> int:
    try:
        written = 0
        for batch in batches:
            if token is None:
                written += await target.write_batch(batch)
            else:
                written += await target.write_batch_idempotent(batch, CommitToken(token))
        if finish:
            await target.finish()
        return written
    finally:
        await target.close()


def rows(path: Path, *columns: str) -> list[tuple[Any, ...]]:
    table = DeltaTable(str(path)).to_pyarrow_table(columns=list(columns) or None)
    return sorted(tuple(row.values()) for row in table.to_pylist())


def test_registered_as_a_sink_whose_modes_declare_what_they_do(tmp_path: Path) -> None:
    spec = get_connector("delta")
    assert set(spec.roles) == {Role.SINK, Role.STREAMING_SINK}
    path = tmp_path / "lake" / "orders"
    append = sink(path).capabilities()
    assert append.bounded_policies == {WritePolicy.APPEND} and append.atomic_watermark
    assert sink(path, mode="upsert", key=["id"]).capabilities().atomic_watermark
    assert not sink(path, mode="replace").capabilities().atomic_watermark
    with pytest.raises(ConfigError, match="gs:// tables are not supported"):
        sink(Path("gs://bucket/orders"))
    with pytest.raises(ConfigError, match="key"):
        sink(path, mode="upsert")
    assert not path.exists()


def test_an_s3_config_is_checked_when_built_and_never_shows_its_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "s3-config-secret-0042"
    good = {"endpoint_url": "http://127.0.0.1:9000", "allow_http": True}
    target = get_connector("delta").sink(
        {"uri": "s3://lake/orders/", "s3": {**good, "access_key_id": "k", "secret_access_key": secret}}
    )
    assert target.dataset_uri() == "delta+s3://lake/orders"
    assert isinstance(target, DeltaSink)
    assert target.config.transaction_app_id() == "faucet:orders"
    assert target.config.redacted()["s3"]["secret_access_key"] == "**********"
    assert secret not in repr(target.config) and secret not in str(target.config.redacted())
    refused = {
        "allow_http": {**good, "allow_http": False},
        "only for a loopback endpoint_url": {**good, "endpoint_url": "http://lake.example.com:9000"},
        "carries credentials": {**good, "endpoint_url": f"http://k:{secret}@127.0.0.1:9000"},
        "go together": {"access_key_id": "k"},
        "needs access_key_id": {"session_token": secret},
    }
    for message, s3 in refused.items():
        with pytest.raises(ConfigError, match=message) as raised:
            get_connector("delta").sink({"uri": "s3://lake/orders", "s3": s3})
        assert secret not in f"{raised.value} {raised.value.where}"

    # A delta-rs error that echoes the secret (a fault injected at the first store call): scrubbed,
    # and not chained, since a traceback prints its cause.
    def echoing(*args: Any, **kwargs: Any) -> bool:
        raise OSError(f"Generic S3 error\n  ↳ could not sign with {secret}")

    monkeypatch.setattr(DeltaTable, "is_deltatable", staticmethod(echoing))
    with pytest.raises(FaucetError, match=r"could not sign with \*{10}") as failed:
        run(target.check())
    assert secret not in str(failed.value) and failed.value.__cause__ is None
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not an s3:// table"):
        get_connector("delta").sink({"uri": "lake/orders", "s3": {"region": "eu-west-1"}})
    with pytest.raises(ConfigError, match="bucket and a folder"):
        get_connector("delta").sink({"uri": "s3://lake"})


def test_s3_failures_are_named_by_kind_an_unreachable_endpoint_retryable(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    lake = s3_lake(s3_server, s3_bucket)

    async def check(target: Sink) -> None:
        try:
            await target.check()
        finally:
            await target.close()

    missing = replace(lake, root="s3://no-such-bucket-here/lake")
    with pytest.raises(ConfigError, match="NoSuchBucket") as raised:
        run(check(missing.sink("orders")))
    assert raised.value.where == "delta+s3://no-such-bucket-here/lake/orders"
    closed = replace(lake, s3={**(lake.s3 or {}), "endpoint_url": "http://127.0.0.1:1"})
    with pytest.raises(ConnectionFailed, match="the S3 endpoint does not answer") as unreachable:
        run(check(closed.sink("orders")))
    assert unreachable.value.retryable
    with S3Server(enforce_auth=True, base_dir=tmp_path) as strict:
        strict.start()
        refusing = replace(lake, s3={**(lake.s3 or {}), "endpoint_url": strict.endpoint_url})
        with pytest.raises(AuthError, match=r"refused the credentials: .*InvalidAccessKeyId") as refused:
            run(check(refusing.sink("orders")))
    assert not refused.value.retryable
    assert s3_server.secret_access_key not in f"{refused.value} {unreachable.value} {raised.value}"


def test_the_commit_token_is_the_tables_transaction_identifier(lake: Lake) -> None:
    assert run(write(lake.sink("orders"), orders([1, 2]), token=5)) == 2
    assert lake.table("orders").transaction_version("faucet:orders") == 5
    assert run(write(lake.sink("orders"), orders([1, 2]), token=5)) == 0  # the same page again
    assert run(write(lake.sink("orders"), orders([3]), token=4)) == 0  # an older one
    assert run(write(lake.sink("orders"), orders([3]), token=6)) == 1
    assert lake.rows("orders", "id") == [(1,), (2,), (3,)]

    async def token_of(target: Sink) -> CommitToken | None:
        try:
            return await target.last_committed_token()
        finally:
            await target.close()

    assert run(token_of(lake.sink("orders"))) == CommitToken(6)
    assert run(token_of(lake.sink("orders", app_id="another"))) is None
    with pytest.raises(UnsupportedOperation):
        run(write(lake.sink("orders", mode="replace"), orders([1]), token=7))


def test_a_writer_whose_snapshot_is_stale_conflicts_and_its_retry_skips_the_page(
    lake: Lake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process commits the same page (same app id and version) after this writer read the
    table and before it commits: Delta's optimistic commit refuses this one; the retry skips it.
    On S3 the refusal is the store's: without conditional puts the second writer would overwrite the
    first's log entry, and its rows would be lost."""
    run(write(lake.sink("orders"), orders([1]), token=1))
    stale = lake.table("orders")
    write_deltalake(
        lake.uri("orders"),
        orders([2, 3]),
        mode="append",
        commit_properties=_transaction(2),
        storage_options=lake.options(),
    )
    others = lake.table("orders").version()  # the other writer's commit
    monkeypatch.setattr(DeltaSink, "open_table", lambda self: stale)
    with pytest.raises(CommitConflict) as raised:
        run(write(lake.sink("orders"), orders([2, 3]), token=2))
    assert raised.value.retryable
    monkeypatch.undo()
    assert run(write(lake.sink("orders"), orders([2, 3]), token=2)) == 0
    assert lake.rows("orders", "id") == [(1,), (2,), (3,)]
    assert lake.table("orders").version() == others  # nothing of the stale writer


def test_a_table_another_writer_created_after_this_one_looked_is_judged_by_what_it_holds(
    lake: Lake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This writer saw no table; meanwhile another created it and committed the same page (and a row
    of the upsert's key): the table's transaction skips the page, and an upsert merges, never appends."""
    run(write(lake.sink("orders"), orders([1, 2]), token=1))
    monkeypatch.setattr(DeltaSink, "open_table", lambda self: None)  # the look before the other's create
    assert run(write(lake.sink("orders"), orders([1, 2]), token=1)) == 0
    run(write(lake.sink("orders", mode="upsert", key=["id"], app_id="keyed"), orders([2, 3]), token=1))
    monkeypatch.undo()
    assert lake.rows("orders", "id") == [(1,), (2,), (3,)]


RACING_PROXY = """
import http.client, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake

upstream_port, table, drop_if_none_match = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "drop"
raced = []


def other_writer():
    page = pa.table({"id": [2, 3], "name": ["other", "other"]})
    done = CommitProperties(app_transactions=[Transaction("faucet:orders", 2)])
    options = table["options"]
    write_deltalake(table["uri"], page, mode="append", commit_properties=done, storage_options=options)


class Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.command == "PUT" and "/_delta_log/" in self.path and not raced:
            raced.append(self.path)
            other_writer()
            print("raced", self.path, flush=True)
        dropped = {"if-none-match"} if drop_if_none_match else set()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
        upstream.request(self.command, self.path, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
print("port", server.server_address[1], flush=True)
server.serve_forever()
"""


@dataclass
class Race:
    lake: Lake
    """The lake through the proxy."""
    raced: list[str]
    """The log entries the other writer committed first (filled when the proxy stops)."""


@contextlib.contextmanager
def commit_race(server: S3Server, lake: Lake, drop_if_none_match: bool = False) -> Iterator[Race]:
    """``lake`` reached through a loopback proxy (another process: delta-rs may hold the GIL while it
    waits for an answer). The first time the writer behind it PUTs a Delta log entry, another writer
    commits that very version (the same app id and token) straight to the endpoint, then the PUT goes
    on, headers untouched. That is the race between a writer listing the log and creating the next
    entry, which a sequential test never reaches: delta-rs lists the log before its PUT, and sees a
    commit that is already there. ``drop_if_none_match`` plays a store without conditional puts."""
    table = {"uri": lake.uri("orders"), "options": lake.options()}
    port = str(urlsplit(server.endpoint_url).port)
    drop = "drop" if drop_if_none_match else "keep"
    proxy = subprocess.Popen(
        [sys.executable, "-c", RACING_PROXY, port, json.dumps(table), drop], stdout=subprocess.PIPE, text=True
    )
    assert proxy.stdout is not None
    race = Race(lake, [])
    try:
        proxy_port = proxy.stdout.readline().split()[-1]
        race.lake = replace(lake, s3={**(lake.s3 or {}), "endpoint_url": f"http://127.0.0.1:{proxy_port}"})
        yield race
    finally:
        proxy.kill()
        race.raced += [
            line.split()[-1] for line in proxy.stdout.read().splitlines() if line.startswith("raced")
        ]
        proxy.wait(timeout=60)


def test_two_writers_racing_for_one_log_entry_on_s3_are_kept_apart_by_the_stores_conditional_put(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Both writers list the log at the same version and PUT the next one: the endpoint creates it for
    the first and answers 412 to the second (``If-None-Match: *``), whose commit becomes a retryable
    CommitConflict; its retry skips the page."""
    lake = s3_lake(s3_server, s3_bucket)
    run(write(lake.sink("orders"), orders([1]), token=1))
    raced_version = lake.table("orders").version() + 1
    with commit_race(s3_server, lake) as race, pytest.raises(CommitConflict) as raised:
        run(write(race.lake.sink("orders"), orders([2, 3]), token=2))
    assert raised.value.retryable
    assert [path.rsplit("/", 1)[-1] for path in race.raced] == [f"{raced_version:020d}.json"]
    assert lake.table("orders").version() == raced_version  # the other writer's commit only
    assert run(write(lake.sink("orders"), orders([2, 3]), token=2)) == 0
    assert lake.rows("orders", "id", "name") == [(1, "n1v1"), (2, "other"), (3, "other")]


def test_the_race_without_conditional_puts_loses_a_commit(s3_server: S3Server, s3_bucket: str) -> None:
    """The same race through a store that ignores ``If-None-Match`` (the proxy drops the header): the
    second PUT replaces the first writer's log entry, its rows are gone and the sink reports success.
    Why the sink needs a store with conditional puts (docs/delta.md), and proof the race is real."""
    lake = s3_lake(s3_server, s3_bucket)
    run(write(lake.sink("orders"), orders([1]), token=1))
    with commit_race(s3_server, lake, drop_if_none_match=True) as race:
        assert run(write(race.lake.sink("orders"), orders([2, 3]), token=2)) == 2
    assert len(race.raced) == 1
    assert lake.rows("orders", "id", "name") == [(1, "n1v1"), (2, "n2v1"), (3, "n3v1")]  # "other" lost


def _transaction(version: int) -> Any:
    from deltalake import CommitProperties, Transaction

    return CommitProperties(app_transactions=[Transaction("faucet:orders", version)])


DYING_WRITER = """
import asyncio, json, os, sys
import pyarrow as pa
import faucet_delta.sink as module
from faucet_dagster.protocol import CommitToken, get_connector

config, when, first, count, token = json.loads(sys.argv[1]), sys.argv[2], *(int(v) for v in sys.argv[3:6])
real = module.write_deltalake


def dying(*args, **kwargs):
    if when == "before-commit":
        os._exit(9)
    real(*args, **kwargs)
    os._exit(9)


module.write_deltalake = dying
target = get_connector("delta").sink(config)
page = pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}v1"} for i in range(first, first + count)])
asyncio.run(target.write_batch_idempotent(page, CommitToken(token)))
"""


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_a_process_dying_around_a_delta_commit_loses_and_duplicates_nothing(lake: Lake, when: str) -> None:
    run(write(lake.sink("orders"), orders(range(1, 101)), token=100))
    done = subprocess.run(
        [sys.executable, "-c", DYING_WRITER, json.dumps(lake.config("orders")), when, "101", "100", "200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr
    committed = when == "after-commit"
    assert len(lake.rows("orders", "id")) == (200 if committed else 100)
    assert lake.table("orders").transaction_version("faucet:orders") == (200 if committed else 100)
    assert run(write(lake.sink("orders"), orders(range(101, 201)), token=200)) == (0 if committed else 100)
    assert lake.rows("orders", "id") == [(i,) for i in range(1, 201)]


def test_upsert_merges_by_key_and_a_row_without_its_key_is_refused(lake: Lake) -> None:
    keyed = pa.concat_batches([orders([1, 2]), orders([2], version=2)])
    run(write(lake.sink("customers", mode="upsert", key=["id"]), keyed, token=1))
    merging = lake.sink("customers", mode="upsert", key=["id"])
    run(write(merging, orders([1, 3], version=3, tier="gold"), token=2))
    assert lake.rows("customers", "id", "name", "tier") == [
        (1, "n1v3", "gold"),
        (2, "n2v2", None),
        (3, "n3v3", "gold"),
    ]
    version = lake.table("customers").version()
    assert merging.commit_details() == {"delta/table_version": version}  # the MERGE's commit
    nameless = pa.RecordBatch.from_pylist([{"id": 4, "name": "a"}, {"id": None, "name": "b"}])
    with pytest.raises(DataError, match="row 1"):
        run(write(lake.sink("customers", mode="upsert", key=["id"]), nameless, token=3))
    assert lake.table("customers").version() == version


def test_replace_commits_one_version_at_finish_and_an_unfinished_run_commits_nothing(lake: Lake) -> None:
    run(write(lake.sink("snapshot"), orders([1, 2, 3])))
    before = lake.table("snapshot").version()

    async def replace(finish: bool) -> None:
        target = lake.sink("snapshot", mode="replace")
        try:
            for first in range(10, 40, 10):
                await target.write_batch(orders(range(first, first + 10)))
            assert lake.table("snapshot").version() == before  # readers still see the old snapshot
            if finish:
                await target.finish()
                assert target.commit_details() == {"delta/table_version": before + 1}
            else:
                assert target.commit_details() == {}  # nothing committed
        finally:
            await target.close()

    run(replace(finish=False))
    assert lake.table("snapshot").version() == before and lake.rows("snapshot", "id") == [(1,), (2,), (3,)]
    run(replace(finish=True))
    assert lake.table("snapshot").version() == before + 1
    assert lake.rows("snapshot", "id") == [(i,) for i in range(10, 40)]


def test_evolution_merges_a_new_column_or_refuses_it_and_a_lossy_type_is_named(lake: Lake) -> None:
    run(write(lake.sink("orders"), orders([1])))
    with pytest.raises(SchemaError, match="coupon"):
        run(write(lake.sink("orders", schema_evolution=False), orders([2], coupon="c2")))
    run(write(lake.sink("orders"), orders([2], coupon="c2")))
    assert lake.rows("orders", "id", "coupon") == [(1, None), (2, "c2")]
    with pytest.raises(SchemaError, match=r"id \(double into int64\)"):
        run(write(lake.sink("orders"), pa.RecordBatch.from_pylist([{"id": 2.5, "name": "x"}])))
    narrow = pa.RecordBatch.from_arrays([pa.array([7], pa.int32()), pa.array(["n"])], names=["id", "name"])
    run(write(lake.sink("orders"), narrow))  # widened to the table's int64
    assert lake.table("orders").schema().to_arrow().field("id").type == pa.int64()
    assert len(lake.rows("orders", "id")) == 3


def test_a_value_a_table_constraint_refuses_is_a_data_error_and_nothing_lands(tmp_path: Path) -> None:
    path = tmp_path / "orders"
    run(write(sink(path), orders([1])))
    DeltaTable(str(path)).alter.add_constraint({"positive": "id > 0"})
    with pytest.raises(DataError, match="Invalid data"):
        run(write(sink(path), orders([2, -3])))
    assert rows(path, "id") == [(1,)]


def test_partition_by_partitions_the_table_it_creates(tmp_path: Path) -> None:
    path = tmp_path / "events"
    batch = pa.RecordBatch.from_pylist([{"id": i, "day": f"2024-01-0{i % 3 + 1}"} for i in range(9)])
    run(write(sink(path, partition_by=["day"]), batch))
    assert DeltaTable(str(path)).metadata().partition_columns == ["day"]
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("day=")) == [
        "day=2024-01-01",
        "day=2024-01-02",
        "day=2024-01-03",
    ]


class Crash(Exception):
    """The process dying right after a page's Delta commit, before the caller stored the result."""


def test_a_sync_crashing_after_a_delta_commit_reruns_without_duplicates(tmp_path: Path, lake: Lake) -> None:
    data = tmp_path / "data"
    data.mkdir()
    lines = ["id,name"] + [f"{i},name {i}" for i in range(1, 1001)]
    (data / "a.csv").write_text("\n".join(lines) + "\n")

    def crash_after_page(report: PageReport) -> None:
        if report.number == 2:
            raise Crash

    def sync(**kwargs: Any) -> BoundedSyncResult:
        source = get_connector("files").source({"paths": [str(data / "*.csv")]})
        target = lake.sink("orders")

        async def go() -> BoundedSyncResult:
            try:
                return await run_bounded_sync(source, target, SyncSettings(batch_size=300), **kwargs)
            finally:
                await source.close()
                await target.close()

        return run(go())

    with pytest.raises(Crash):
        sync(on_page=crash_after_page)
    assert len(lake.rows("orders", "id")) == 600
    rerun = sync()
    # The rerun resumes from the bookmark the commit recorded with its transaction identifier.
    assert (rerun.rows_read, rerun.rows_skipped, rerun.rows_written) == (400, 0, 400)
    assert rerun.plan.delivery.value == "effectively_once"
    assert lake.rows("orders", "id") == [(i,) for i in range(1, 1001)]
