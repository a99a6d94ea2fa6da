"""``faucet verify`` on real servers: a clean stream verifies, and every tampering is found and named.

A NATS JetStream stream runs into PostgreSQL through the continuous runner (several epochs); then
the verifier re-reads each certificate's range from the stream and compares it with the table. Each
tamper test changes one thing behind the stream's back (a row of the destination, a certificate in the
state store, the source itself) and checks that ``verify_stream`` reports that certificate diverged,
naming what it found; the untouched stream around it stays verified.
"""

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import nats
import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource
from faucet_nats.config import NatsSourceConfig
from faucet_nats.sink import NatsStreamingSink
from faucet_nats.sink_config import NatsSinkConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from kafka_topics import create_topic, produce_json

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.declarations.verification import VERIFY_CHECK, verify_schedule
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import EpochCertificate, EventIdentity, Identities, ReadLimits, WritePolicy
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.state.certificates import fingerprint_and_body
from faucet_dagster.state.tables import certificates_table
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.streams.reports import AssetTarget, report_events
from faucet_dagster.syncs.assets import faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync
from faucet_dagster.syncs.verification import faucet_sync_checks
from faucet_dagster.verify import Outcome, Report, VerifyOptions, verify_stream

COLUMNS = {"id": "int64 not null", "name": "string"}
EPOCH_COLUMN = "_faucet_epoch"
SEQUENCE = f"({EPOCH_COLUMN} & 4294967295)"
"""The epoch sequence in the epoch column (its low 32 bits; the stream's id is above them)."""


@dataclass
class Stream:
    """One test's NATS stream into one PostgreSQL table, its state store and runner spec."""

    nats_url: str
    postgres_url: str
    name: str
    store: StateStore
    policy: WritePolicy = WritePolicy.APPEND
    published: int = 0

    @property
    def table(self) -> str:
        return f"{self.name}_rows"

    def spec(self, **sink: Any) -> StreamSpec:
        source = NatsSourceConfig.parse({"servers": [self.nats_url], "stream": self.name, "columns": COLUMNS})
        sink_config = {"url": self.postgres_url, "table": self.table, "epoch_column": EPOCH_COLUMN, **sink}
        return StreamSpec(
            name=self.name,
            source=NatsStreamSource(source),
            sink=PostgresStreamingSink(PostgresStreamingSinkConfig.parse(sink_config)),
            resources=(self.name,),
            policy=self.policy,
            key=("id",) if self.policy is not WritePolicy.APPEND else (),
            schemas={self.name: ResourceSchema.from_columns(COLUMNS)},
            limits=ReadLimits(records=100, idle=0.2),
            lease_seconds=30,
        )

    def publish(self, rows: list[dict[str, Any]]) -> None:
        async def send() -> None:
            client = await nats.connect(self.nats_url)
            try:
                js = client.jetstream()
                for row in rows:
                    await js.publish(f"{self.name}.rows", json.dumps(row).encode())
            finally:
                await client.close()

        asyncio.run(send())
        self.published += len(rows)

    def run(self, **sink: Any) -> list[EpochCertificate]:
        """Run epochs until the stream has certified everything published."""

        async def scenario() -> list[EpochCertificate]:
            runner = StreamRunner(self.spec(**sink), self.store, worker_id="w1")
            try:
                return await runner.run_epochs(30.0)
            finally:
                await runner.close()

        return asyncio.run(scenario())

    def verify(self, **options: Any) -> Report:
        return asyncio.run(
            verify_stream(self.spec(), self.store, VerifyOptions(**{"first": 1, "record": False, **options}))
        )

    def sql(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            cursor = conn.execute(statement.replace("{table}", f'"{self.table}"'), params)
            return cursor.fetchall() if cursor.description else []


def outcomes(report: Report) -> dict[int, Outcome]:
    return {item.sequence: item.outcome for item in report.verifications}


def found(report: Report, sequence: int) -> list[str]:
    """The kinds of problem found for certificate ``sequence``."""
    [item] = [item for item in report.verifications if item.sequence == sequence]
    return [finding.kind for finding in item.problems]


async def _create(nats_url: str, name: str) -> None:
    client = await nats.connect(nats_url)
    try:
        await client.jetstream().add_stream(name=name, subjects=[f"{name}.>"])
    finally:
        await client.close()


@pytest.fixture
def streams(
    nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[Callable[[WritePolicy], Stream]]:
    """Streams of the given policy, each with 300 rows ``{"id": n, "name": "row-n"}`` certified in
    three epochs or more."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")

    def make(policy: WritePolicy) -> Stream:
        name = unique_name("v")
        asyncio.run(_create(nats_url, name))
        made = Stream(nats_url, postgres_url, name, store, policy)
        made.publish([{"id": n, "name": f"row-{n}"} for n in range(300)])
        certificates = made.run()
        assert sum(sum(c.row_counts.values()) for c in certificates) == 300 and len(certificates) >= 3
        return made

    yield make
    store.close()


@pytest.fixture
def stream(streams: Callable[[WritePolicy], Stream]) -> Stream:
    return streams(WritePolicy.APPEND)


def test_an_untouched_stream_verifies_and_a_tampered_row_is_named(stream: Stream) -> None:
    clean = stream.verify()
    assert set(outcomes(clean).values()) == {Outcome.VERIFIED}, clean.verifications
    assert clean.rows_replayed == 300 and clean.rows_compared == 300
    [(index,)] = stream.sql("SELECT indexdef FROM pg_indexes WHERE tablename = %s", stream.table)
    assert "USING brin (_faucet_epoch)" in index  # an epoch's rows are found without a table scan

    # A row deleted at the destination: its certificate diverged, naming the event's position.
    [(stamp, epoch)] = stream.sql(
        f"DELETE FROM {{table}} WHERE id = 150 RETURNING {EPOCH_COLUMN}, {SEQUENCE}"
    )
    report = stream.verify()
    assert outcomes(report)[epoch] is Outcome.DIVERGED and found(report, epoch) == ["missing row"]
    assert "@151#0" in report.verifications[epoch - 1].problems[0].where  # stream sequence 151
    assert {s for s, o in outcomes(report).items() if o is Outcome.DIVERGED} == {epoch}
    stream.sql("INSERT INTO {table} (id, name, " + EPOCH_COLUMN + ") VALUES (150, 'row-150', %s)", stamp)

    # A row changed: named with what it should hold and what it holds.
    stream.sql("UPDATE {table} SET name = 'forged' WHERE id = 42")
    report = stream.verify()
    [(epoch,)] = stream.sql(f"SELECT {SEQUENCE} FROM {{table}} WHERE id = 42")
    assert found(report, epoch) == ["changed row"]
    detail = report.verifications[epoch - 1].problems[0].detail
    assert "row-42" in detail and "forged" in detail
    stream.sql("UPDATE {table} SET name = 'row-42' WHERE id = 42")

    # A row duplicated.
    stream.sql("INSERT INTO {table} SELECT * FROM {table} WHERE id = 7")
    [(epoch,)] = stream.sql(f"SELECT DISTINCT {SEQUENCE} FROM {{table}} WHERE id = 7")
    report = stream.verify()
    assert found(report, epoch) == ["duplicated row"]
    assert "2 copies" in report.verifications[epoch - 1].problems[0].detail
    stream.sql("DELETE FROM {table} WHERE ctid = (SELECT max(ctid) FROM {table} WHERE id = 7)")
    assert set(outcomes(stream.verify()).values()) == {Outcome.VERIFIED}


def _certificate_row(store: StateStore, name: str, sequence: int) -> dict[str, Any]:
    with store.transaction("read") as conn:
        row = conn.execute(
            sa.select(certificates_table).where(
                certificates_table.c.stream == name, certificates_table.c.sequence == sequence
            )
        ).one()
        return dict(row._mapping)


def _write_certificate(store: StateStore, row: dict[str, Any], **changes: Any) -> None:
    with store.transaction("tamper") as conn:
        table = certificates_table.c
        conn.execute(
            sa.delete(certificates_table).where(
                table.stream == row["stream"], table.sequence == row["sequence"]
            )
        )
        conn.execute(certificates_table.insert(), [{**row, **changes}])


def test_a_certificate_altered_or_removed_in_the_state_store_is_named(stream: Stream) -> None:
    # Altered: the body's row count changed, its fingerprint column left alone.
    row = _certificate_row(stream.store, stream.name, 2)
    body = json.loads(row["body"])
    body["row_counts"] = {stream.name: 99}
    _write_certificate(stream.store, row, body=json.dumps(body))
    report = stream.verify()
    assert outcomes(report)[2] is Outcome.DIVERGED
    assert "altered certificate" in found(report, 2) and "row count differs" in found(report, 2)
    assert outcomes(report)[1] is outcomes(report)[3] is Outcome.VERIFIED

    # Altered with a fingerprint to match: the store's certified positions and the source still tell.
    forged = EpochCertificate.from_json(row["body"])
    [item] = forged.coverage
    forged_body = json.loads(row["body"])
    forged_body["coverage"][0]["end"] = str(int(item.end) - 10)
    fingerprint, body_text = fingerprint_and_body(EpochCertificate.from_json(json.dumps(forged_body)))
    _write_certificate(stream.store, row, body=body_text, fingerprint=fingerprint)
    report = stream.verify()
    assert {"gap", "row count differs"} <= set(found(report, 3) + found(report, 2)), report.verifications
    _write_certificate(stream.store, row)

    # Removed: the sequence is missing, and the next certificate's coverage has nothing before it.
    with stream.store.transaction("tamper") as conn:
        table = certificates_table.c
        conn.execute(sa.delete(certificates_table).where(table.stream == stream.name, table.sequence == 2))
    report = stream.verify()
    assert found(report, 2) == ["missing certificate"]
    assert "gap" in found(report, 3)
    assert outcomes(report)[1] is Outcome.VERIFIED


def test_a_certificate_written_over_a_skipped_range_is_a_gap(stream: Stream) -> None:
    """A certificate forged into the table (with a valid fingerprint) that skips positions: the chain
    names the gap, and the store's certified positions show the store never wrote it."""
    last = _certificate_row(stream.store, stream.name, 3)
    certificate = EpochCertificate.from_json(last["body"])
    [item] = certificate.coverage
    plain = json.loads(last["body"])
    plain.update(sequence=4, row_counts={stream.name: 50})
    plain["coverage"][0].update(start=str(int(item.end) + 50), end=str(int(item.end) + 100))
    plain["receipts"][0].update(rows_written=50, rows_skipped=0)
    fingerprint, body = fingerprint_and_body(EpochCertificate.from_json(json.dumps(plain)))
    _write_certificate(stream.store, {**last, "sequence": 4, "fingerprint": fingerprint, "body": body})
    report = stream.verify()
    assert outcomes(report)[4] is Outcome.DIVERGED
    assert {"gap", "position not moved"} <= set(found(report, 4)), found(report, 4)
    gap = next(f for f in report.verifications[3].problems if f.kind == "gap")
    assert f"after {item.end} up to {int(item.end) + 50}" in gap.detail
    assert [outcomes(report)[s] for s in (1, 2, 3)] == [Outcome.VERIFIED] * 3


def test_a_source_recreated_under_the_same_name_is_named(stream: Stream) -> None:
    async def recreate() -> None:
        client = await nats.connect(stream.nats_url)
        try:
            await client.jetstream().delete_stream(stream.name)
        finally:
            await client.close()
        await _create(stream.nats_url, stream.name)

    asyncio.run(recreate())
    stream.publish([{"id": n, "name": f"other-{n}"} for n in range(300)])
    report = stream.verify()
    assert set(outcomes(report).values()) == {Outcome.DIVERGED}
    for item in report.verifications:
        assert found(report, item.sequence) == ["source re-created", "not compared"], item.problems
    assert "re-created" in report.verifications[0].problems[0].detail


def test_a_range_the_source_no_longer_holds_is_not_replayable_never_ok(stream: Stream) -> None:
    async def purge() -> None:
        client = await nats.connect(stream.nats_url)
        try:
            await client.jetstream().purge_stream(stream.name, seq=151)  # removes sequences 1..150
        finally:
            await client.close()

    asyncio.run(purge())
    report = stream.verify()
    assert outcomes(report)[1] is Outcome.NOT_VERIFIABLE
    assert found(report, 1) == ["not replayable", "not compared"]
    assert outcomes(report)[3] is Outcome.VERIFIED


def test_kafka_partitions_into_nats_verify_and_a_republished_message_is_named(
    kafka_bootstrap: str, nats_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    """Kafka (two partitions: two domains per certificate) into NATS: verified clean; a message of
    an event published again after the duplicate window, with other contents, is a duplicated and
    changed row of the certificate that wrote the event."""
    topic, target = unique_name("topic"), unique_name("out")
    create_topic(kafka_bootstrap, topic, 2)

    async def create_target() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(
                name=target, subjects=[f"{target}.rows"], duplicate_window=0.5
            )
        finally:
            await client.close()

    asyncio.run(create_target())
    spec = StreamSpec(
        name=unique_name("stream"),
        source=KafkaStreamSource(
            KafkaSourceConfig(bootstrap_servers=kafka_bootstrap, topics=(topic,), group_id=unique_name("g"))
        ),
        sink=NatsStreamingSink(
            NatsSinkConfig(
                servers=(nats_url,),
                stream=target,
                subject=f"{target}.rows",
                duplicate_window=0.5,
                watermark_bucket=f"w_{target}",
            )
        ),
        resources=(topic,),
        limits=ReadLimits(records=100, idle=0.3),
    )
    produce_json(kafka_bootstrap, topic, 0, 240, partitions=2)
    with StateStore(f"sqlite:///{tmp_path / 'state.db'}") as store:

        async def scenario() -> Report:
            runner = StreamRunner(spec, store, worker_id="w1")
            try:
                certificates = await runner.run_epochs(30.0)
            finally:
                await runner.close()
            assert sum(sum(c.row_counts.values()) for c in certificates) == 240
            return await verify_stream(spec, store)

        clean = asyncio.run(scenario())
        assert set(outcomes(clean).values()) == {Outcome.VERIFIED}, [v.problems for v in clean.verifications]
        assert clean.rows_compared == 240
        reread = {f.where for item in clean.verifications for f in item.findings if f.kind == "re-read"}
        assert len(reread) == 2  # both partitions' ranges re-read

        # The event at offset 3 of partition 1 published again, changed, past the duplicate window.
        certificate, domain = next(
            (certificate, item.domain)
            for certificate in store.certificates(spec.name)
            for item in certificate.coverage
            if item.domain.partition == "1" and item.start is None
        )
        identity = EventIdentity(domain, "3")

        async def republish() -> None:
            client = await nats.connect(nats_url)
            try:
                await asyncio.sleep(0.6)
                await client.jetstream().publish(
                    f"{target}.rows", b'{"id":7,"name":"forged"}', headers={"Nats-Msg-Id": identity.digest()}
                )
            finally:
                await client.close()

        asyncio.run(republish())
        report = asyncio.run(verify_stream(spec, store, VerifyOptions(first=1, record=False)))
        tampered = report.verifications[certificate.sequence - 1]
        assert found(report, certificate.sequence) == ["changed row", "duplicated row"], tampered.problems
        assert str(identity) in tampered.problems[0].where and "forged" in tampered.problems[0].detail
        others = [item.outcome for item in report.verifications if item.sequence != certificate.sequence]
        assert set(others) == {Outcome.VERIFIED}


def test_keyed_state_verifies_and_a_later_epoch_supersedes_not_diverges(
    streams: Callable[[WritePolicy], Stream],
) -> None:
    """UPSERT by id: rows the next epochs changed are superseded, not differences; a row changed or
    deleted behind the stream's back is."""
    keyed = streams(WritePolicy.UPSERT)
    keyed.publish([{"id": n, "name": f"v2-{n}"} for n in range(0, 300, 3)])
    assert sum(sum(c.row_counts.values()) for c in keyed.run()) == 100
    report = keyed.verify()
    assert set(outcomes(report).values()) == {Outcome.VERIFIED}, [v.problems for v in report.verifications]
    # The first three epochs alone: the keys the later ones changed are superseded, not changed.
    report = keyed.verify(last=3)
    assert set(outcomes(report).values()) == {Outcome.VERIFIED}, [v.problems for v in report.verifications]
    details = " ".join(f.detail for item in report.verifications for f in item.findings)
    assert "100 keyed rows a later epoch changed were not compared" in details

    keyed.sql("UPDATE {table} SET name = 'forged' WHERE id = 299")  # written once, by the third epoch
    [(epoch,)] = keyed.sql(f"SELECT {SEQUENCE} FROM {{table}} WHERE id = 299")
    report = keyed.verify()
    assert (
        found(report, epoch) == ["changed row"]
        and "forged" in report.verifications[epoch - 1].problems[0].detail
    )
    keyed.sql("DELETE FROM {table} WHERE id = 3")  # last written by a v2 epoch
    report = keyed.verify()
    assert {kind for item in report.verifications for kind in found(report, item.sequence)} == {
        "changed row",
        "missing row",
    }


def test_the_faucet_verify_check_runs_on_a_schedule_and_sees_a_certificate_changed_after_its_report(
    stream: Stream, tmp_path: Path
) -> None:
    """The asset check of ``build_stream_defs``, run by the job of ``verify_schedule``: it verifies the
    certificates after the last verified one, compares them with the materializations Dagster
    received, and fails (ERROR) when the store's certificate is not the one reported."""
    declared = FaucetStream(
        name=stream.name,
        source=FaucetEndpoint(
            FaucetConnection(connector="nats", config={"servers": [stream.nats_url], "stream": stream.name})
        ),
        sink=FaucetEndpoint(
            FaucetConnection(
                connector="postgres",
                config={"url": stream.postgres_url, "table": stream.table, "epoch_column": EPOCH_COLUMN},
            )
        ),
        resources=(stream.name,),
        schemas={stream.name: ResourceSchema.from_columns(COLUMNS)},
        state_url=stream.store.where.removeprefix("state store "),
    )
    defs = build_stream_defs([declared])
    [check] = [c for c in defs.asset_checks or [] if VERIFY_CHECK in {k.name for k in c.check_keys}]
    schedule = verify_schedule([check], "0 * * * *")
    key = declared.asset_spec().key
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        # What the sensor reports: one materialization listing the certificates.
        certificates = stream.store.certificates(stream.name)
        instance.report_runless_asset_event(report_events(certificates, [AssetTarget(key)])[0])
        stream.store.mark_reported(stream.name, 3)
        job = dg.Definitions.merge(defs, dg.Definitions(schedules=[schedule])).resolve_job_def(
            "faucet_verify_job"
        )

        def evaluate() -> dg.AssetCheckEvaluation:
            [evaluation] = job.execute_in_process(instance=instance).get_asset_check_evaluations()
            return evaluation

        first = evaluate()
        assert first.passed, first.metadata["faucet/problems"]
        assert first.metadata["faucet/verified"].value == 3
        table = first.metadata["faucet/verification"].value
        assert [row.data["reports"] for row in table.records] == ["verified"] * 3
        again = evaluate()  # nothing new since: passes, says so
        assert again.passed and again.metadata["faucet/outcome"].value == "nothing to verify"

        # The third certificate, changed in the store after Dagster received it (its fingerprint too).
        row = _certificate_row(stream.store, stream.name, 3)
        plain = json.loads(row["body"])
        plain["worker"] = "someone-else"
        fingerprint, body = fingerprint_and_body(EpochCertificate.from_json(json.dumps(plain)))
        _write_certificate(stream.store, row, body=body, fingerprint=fingerprint, worker="someone-else")
        with stream.store.transaction("forget") as conn:
            conn.execute(sa.text("DELETE FROM faucet_verifications"))
        tampered = evaluate()
        assert not tampered.passed and tampered.severity is dg.AssetCheckSeverity.ERROR
        assert "reported differently" in tampered.metadata["faucet/problems"].value
        assert "fingerprint differs" in tampered.metadata["faucet/problems"].value


def test_the_cli_prints_a_line_per_certificate_and_exits_by_the_worst_outcome(
    stream: Stream, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"verify_location_{stream.name}"
    (tmp_path / f"{module}.py").write_text(
        f"""
from faucet_dagster import FaucetStream, build_stream_defs
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.pipeline import ResourceSchema

defs = build_stream_defs([
    FaucetStream(
        name={stream.name!r},
        source=FaucetEndpoint(FaucetConnection(connector="nats", config={{"servers": [{stream.nats_url!r}],
            "stream": {stream.name!r}}})),
        sink=FaucetEndpoint(FaucetConnection(connector="postgres", config={{"url": {stream.postgres_url!r},
            "table": {stream.table!r}, "epoch_column": {EPOCH_COLUMN!r}}})),
        resources=({stream.name!r},),
        schemas={{{stream.name!r}: ResourceSchema.from_columns({COLUMNS!r})}},
        state_url={stream.store.where.removeprefix("state store ")!r},
    )
])
"""
    )
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    verify = [
        "verify",
        "-m",
        module,
        "-d",
        str(tmp_path),
        "--stream",
        stream.name,
        "--from",
        "1",
        "--no-record",
    ]
    assert main(verify) == 0
    out = capsys.readouterr().out
    assert out.count(" verified ") >= 3 and "3 verified" in out

    stream.sql("DELETE FROM {table} WHERE id = 250")
    assert main(verify) == 1
    out = capsys.readouterr().out
    assert "diverged" in out and "missing row" in out and '{"id": 250, "name": "row-250"}' in out

    assert main([*verify, "--json", "--to", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [item["outcome"] for item in report["verifications"]] == ["verified"]
    assert main([*verify, "--stream", "nowhere"]) == 2


def test_bounded_syncs_verify_bookmark_to_bookmark_and_a_deleted_row_is_named(
    tmp_path: Path, postgres_url: str
) -> None:
    """Files into PostgreSQL in two runs (APPEND), and a PostgreSQL table read by its keyset into
    another (UPSERT): the ``faucet_verify`` checks of the syncs re-read each run bookmark to bookmark
    and compare the tables; a row deleted at the destination is named."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("id,name\n" + "".join(f"{i},n{i}\n" for i in range(300)))
    warehouse = FaucetConnection(connector="postgres", config={"url": postgres_url})
    files = FaucetSync(
        "files_rows",
        source=FaucetConnection(connector="files").using(paths=[str(data / "*.csv")]),
        sink=warehouse.using(table="files_rows"),
        batch_size=120,
    )
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE src (id bigint PRIMARY KEY, name text)")
        conn.execute("INSERT INTO src SELECT i, 'v' || i FROM generate_series(1, 250) i")
    keyed = FaucetSync(
        "keyed_rows",
        source=warehouse.using(table="src", key=["id"]),
        sink=warehouse.using(table="keyed_rows", mode="upsert", key=["id"]),
        batch_size=100,
    )
    syncs = [files, keyed]
    defs = dg.Definitions(assets=faucet_sync_assets(syncs), asset_checks=faucet_sync_checks(syncs, runs=2))
    job = dg.Definitions.merge(
        defs, dg.Definitions(schedules=[verify_schedule(defs.asset_checks or [], "@daily")])
    )
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        dg.materialize(faucet_sync_assets(syncs), instance=instance)
        (data / "b.csv").write_text("id,name\n" + "".join(f"{i},n{i}\n" for i in range(300, 500)))
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("INSERT INTO src SELECT i, 'v' || i FROM generate_series(251, 300) i")
        dg.materialize(faucet_sync_assets(syncs), instance=instance)

        def evaluate() -> dict[str, dg.AssetCheckEvaluation]:
            result = job.resolve_job_def("faucet_verify_job").execute_in_process(instance=instance)
            return {e.asset_key.path[-1]: e for e in result.get_asset_check_evaluations()}

        clean = evaluate()
        for name, evaluation in clean.items():
            assert evaluation.passed, (name, evaluation.metadata["faucet/problems"].value)
            assert evaluation.metadata["faucet/verified"].value == 2
        assert clean["files_rows"].metadata["faucet/rows_compared"].value == 500  # both runs, exactly
        assert clean["keyed_rows"].metadata["faucet/rows_compared"].value == 300

        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("DELETE FROM files_rows WHERE id = 310")
            conn.execute("DELETE FROM keyed_rows WHERE id = 5")
        tampered = evaluate()
        files_problems = tampered["files_rows"].metadata["faucet/problems"].value
        assert not tampered["files_rows"].passed and "missing row" in files_problems
        assert '"id": 310' in files_problems and "#2" in files_problems  # the second run's row
        keyed_problems = tampered["keyed_rows"].metadata["faucet/problems"].value
        assert not tampered["keyed_rows"].passed and '"id": 5' in keyed_problems and "#1" in keyed_problems


def test_row_digests_do_not_depend_on_batching_or_interleaving_but_on_every_value() -> None:
    """What a replay recomputes: the same rows, cut into other batches and interleaved otherwise across
    domains, give the same row digests; one value changed gives another."""
    from faucet_dagster.pipeline import Pipeline, PipelineOptions
    from faucet_dagster.protocol import (
        Coverage,
        DomainCoverage,
        EpochId,
        Identities,
        OrderingDomain,
        ProgressBoundary,
    )
    from faucet_dagster.verify.replay import _Collector

    domains = [OrderingDomain("kafka", "t", str(p), "cluster:topic", "kafka.offset") for p in range(2)]
    rows = {
        p: [{"id": p * 1000 + i, "name": None if i % 7 == 0 else f"n{i}"} for i in range(9_000)]
        for p in range(2)
    }

    schema = ResourceSchema.from_columns(COLUMNS)
    # As a source may hand Arrow batches: slices of a larger batch, at an offset that is no multiple of 8.
    arrow = {
        p: pa.RecordBatch.from_pylist(rows[p][:7] + rows[p] + rows[p][:11], schema=schema.schema)
        for p in range(2)
    }

    async def digests(
        batch_rows: int, chunk: int, interleave: bool, change: int | None = None, sliced: bool = False
    ) -> dict[str, str]:
        pipeline = Pipeline({"t": schema}, options=PipelineOptions(batch_rows))
        epoch = pipeline.begin(EpochId("s", 1, 1), _Collector(), [])
        order = [(p, s) for s in range(0, 9_000, chunk) for p in range(2)]
        if not interleave:
            order.sort()
        for partition, start in order:
            part: Any = [dict(row) for row in rows[partition][start : start + chunk]]
            if change is not None and partition == 1 and start <= change < start + chunk:
                part[change - start]["name"] = "changed"
            if sliced:
                part = arrow[partition].slice(7 + start, min(chunk, 9_000 - start))
            positions = [str(i) for i in range(start, start + part_rows(part))]
            await epoch.write(domains[partition], part, Identities(positions))
        for domain in domains:
            await epoch.control(ProgressBoundary(domain, "8999"))
        sealed = await epoch.seal(Coverage(tuple(DomainCoverage(d, None, "8999") for d in domains)))
        assert sealed.row_counts == {"t": 18_000}
        return dict(sealed.row_digests)

    reference = asyncio.run(digests(4_096, 4_096, True))  # chunks that are whole, fresh batches
    assert asyncio.run(digests(16_384, 500, True)) == reference
    assert asyncio.run(digests(700, 333, False)) == reference
    assert asyncio.run(digests(4_096, 9_000, True)) == reference
    assert asyncio.run(digests(5_000, 5_000, True, sliced=True)) == reference
    assert asyncio.run(digests(700, 333, False, change=4_321)) != reference


def part_rows(part: Any) -> int:
    return part.num_rows if isinstance(part, pa.RecordBatch) else len(part)


class OverReadingSource(NatsStreamSource):
    """The real NATS source, whose re-read writes one record past the range it was asked for: the
    fault a connector's replay could have (reading on to the stream's end)."""

    async def replay(self, coverage: Any, sink: Any, cancel: Any) -> None:
        await super().replay(coverage, sink, cancel)
        beyond = str(int(coverage.end) + 1)
        await sink.write(coverage.domain, [{"id": -1, "name": "beyond"}], Identities([beyond]))


def test_a_replay_that_reads_past_its_range_is_refused_not_counted(stream: Stream) -> None:
    spec = stream.spec()
    over = StreamSpec(**{**spec.__dict__, "source": OverReadingSource(spec.source.config)})  # type: ignore[attr-defined]
    report = asyncio.run(verify_stream(over, stream.store, VerifyOptions(first=1, record=False)))
    for item in report.verifications:
        assert found(report, item.sequence) == ["replay differs", "not compared"], item.problems
        assert "past the certified range" in item.problems[0].detail


def test_the_epoch_column_is_added_to_an_existing_table_whatever_schema_evolution_says(
    nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    name = unique_name("v")
    asyncio.run(_create(nats_url, name))
    with StateStore(f"sqlite:///{tmp_path / 'state.db'}") as store:
        made = Stream(nats_url, postgres_url, name, store)
        made.sql("CREATE TABLE {table} (id bigint NOT NULL, name text)")
        made.sql("INSERT INTO {table} VALUES (-1, 'written before the stream')")
        made.publish([{"id": n, "name": f"row-{n}"} for n in range(150)])
        assert sum(sum(c.row_counts.values()) for c in made.run()) == 150
        assert made.sql(f"SELECT count(*) FROM {{table}} WHERE {EPOCH_COLUMN} IS NULL") == [(1,)]
        report = made.verify()
        assert set(outcomes(report).values()) == {Outcome.VERIFIED}, [
            v.problems for v in report.verifications[:3]
        ]
