"""What a tick reports of certificates, in numbers and words (no server: certificates made here):
throughput over busy time, short domain names, metadata typed for plots, one materialization per asset
however many certificates, and the sensor's cursor (read back from older versions too)."""

import dagster as dg
import pytest

from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    DomainCoverage,
    EpochCertificate,
    OrderingDomain,
    Receipt,
    SourceLag,
)
from faucet_dagster.streams.certificates import CERTIFICATE_CHECK
from faucet_dagster.streams.cursor import Halt, StreamCursor, parse_cursor
from faucet_dagster.streams.reports import (
    IDLE_TIMING,
    AssetTarget,
    Report,
    busy_seconds,
    describe_lag,
    domain_label,
    report_events,
)

KAFKA = OrderingDomain(
    "kafka", "orders", "3", "MkU3OEVBNTcwNTJENDM2Qk" * 4 + ":aTRZ3fWqT8y1aN2bV7x9qg", "kafka.offset"
)


def certificate(
    sequence: int,
    rows: dict[str, int],
    *,
    timings: dict[str, float] | None = None,
    lag: tuple[SourceLag, ...] = (),
    start: str | None = None,
) -> EpochCertificate:
    return EpochCertificate(
        stream="events",
        sequence=sequence,
        fencing_token=7,
        worker="host:1:abc",
        coverage=(DomainCoverage(KAFKA, start, str(sequence * 100)),),
        receipts=tuple(
            Receipt(resource, count, 0, {"database": "shop", "table": f"public.{resource}"})
            for resource, count in rows.items()
        ),
        row_counts=rows,
        digest=f"blake2b-256:{sequence:064x}",
        delivery=Delivery.EFFECTIVELY_ONCE,
        timings=timings or {"read_and_seal": 1.0, "commit": 1.0},
        created_at=f"2026-01-01T00:00:{sequence:02d}+00:00",
        lag=lag,
    )


def test_throughput_counts_busy_seconds_not_a_read_waiting_on_an_idle_source() -> None:
    idle = certificate(
        1, {"orders": 1_000}, timings={"read_and_seal": 30.0, "commit": 0.5, IDLE_TIMING: 29.5}
    )
    assert busy_seconds(idle) == pytest.approx(1.0)
    assert Report((idle,)).rows_per_second() == pytest.approx(1_000.0)


def test_a_domain_is_shown_without_its_incarnation_which_stays_in_the_certificate() -> None:
    assert domain_label(KAFKA) == "kafka/orders/3"
    lag = (SourceLag(KAFKA, "99", "149", 50, "offsets"),)
    assert describe_lag(lag) == "50 offsets in kafka/orders/3"
    assert describe_lag((SourceLag(KAFKA, "9", "9", 0, "offsets"),)) == "0 offsets (caught up)"
    report = Report((certificate(1, {"orders": 10}, lag=lag),))
    [materialization, _] = report_events(report.certificates, [AssetTarget(dg.AssetKey("events"))])
    assert isinstance(materialization, dg.AssetMaterialization)
    coverage = materialization.metadata["faucet/coverage"]
    assert isinstance(coverage, dg.TableMetadataValue)
    assert [row.data["domain"] for row in coverage.records] == ["kafka/orders/3"]
    last = materialization.metadata["faucet/last_certificate"]
    assert isinstance(last, dg.JsonMetadataValue) and KAFKA.incarnation in str(last.data)


def test_one_materialization_covers_every_certificate_its_numbers_typed_for_plots() -> None:
    certificates = [
        certificate(n, {"orders": 100}, start=None if n == 1 else str((n - 1) * 100)) for n in (1, 2, 3)
    ]
    events = report_events(certificates, [AssetTarget(dg.AssetKey("events"))])
    [materialization] = [e for e in events if isinstance(e, dg.AssetMaterialization)]
    [evaluation] = [e for e in events if isinstance(e, dg.AssetCheckEvaluation)]
    metadata = materialization.metadata
    assert isinstance(metadata["faucet/epochs"], dg.IntMetadataValue) and metadata["faucet/epochs"].value == 3
    assert isinstance(metadata["faucet/rows_written"], dg.IntMetadataValue)
    assert metadata["faucet/rows_written"].value == 300
    for identifier, text in (
        ("faucet/first_sequence", "1"),
        ("faucet/last_sequence", "3"),
        ("faucet/fencing_token", "7"),
    ):
        assert metadata[identifier] == dg.MetadataValue.text(text)
    assert metadata["faucet/rows_dead_lettered"] == dg.MetadataValue.text("0")
    table = metadata["faucet/certificates"]
    assert isinstance(table, dg.TableMetadataValue)
    assert [(r.data["sequence"], r.data["rows"]) for r in table.records] == [
        ("1", 100),
        ("2", 100),
        ("3", 100),
    ]
    assert str(materialization.description).startswith("certified 3 epochs (1 to 3), 300 rows; lag ")
    assert evaluation.check_name == CERTIFICATE_CHECK and evaluation.passed


def test_the_certificate_evaluation_fails_on_a_gap_with_the_previous_report() -> None:
    previous = certificate(1, {"orders": 10})
    gap = certificate(3, {"orders": 10}, start="250")
    [_, evaluation] = report_events([gap], [AssetTarget(dg.AssetKey("events"))], {"events": previous})
    assert isinstance(evaluation, dg.AssetCheckEvaluation) and not evaluation.passed
    assert "certificate 3 follows 1" in str(evaluation.description)


def test_a_replica_of_several_tables_reports_each_table_it_wrote_to_its_own_asset() -> None:
    certificates = [
        certificate(1, {"public.orders": 5, "public.lines": 20}),
        certificate(2, {"public.lines": 3}),
    ]
    targets = [
        AssetTarget(dg.AssetKey(["shop", "public", table]), frozenset([f"public.{table}"]))
        for table in ("orders", "lines", "docs")
    ]
    events = report_events(certificates, targets)
    reports = {e.asset_key.path[-1]: e for e in events if isinstance(e, dg.AssetMaterialization)}
    assert set(reports) == {"orders", "lines"}, "a table these epochs left as it was is not reported"
    assert reports["lines"].metadata["faucet/rows_written"] == dg.MetadataValue.int(23)
    assert reports["orders"].metadata["dagster/table_name"] == dg.MetadataValue.text(
        "shop.public.public.orders"
    )


def test_the_cursor_reads_older_versions_and_carries_a_halt() -> None:
    assert parse_cursor(None, "s").reported_through == {}
    assert parse_cursor('{"version": 1, "reported_through": 4}', "s").reported_through == {"s": 4}
    assert parse_cursor('{"version": 1, "reported_through": {"s[0/2]": 3}}', "s").reported_through == {
        "s[0/2]": 3
    }
    halt = Halt("ConnectionFailed: refused", "check the server", 1_800_000_000.0, ticks=2)
    written = StreamCursor({"s": 9}, health="halt:ConnectionFailed", halt=halt).format()
    read = parse_cursor(written, "s")
    assert read.halt == halt and read.health == "halt:ConnectionFailed" and read.reported_through == {"s": 9}
    assert (
        halt.again().describe().startswith("halted since 2027-01-15 08:00:00 UTC (3 ticks): ConnectionFailed")
    )
    with pytest.raises(ConfigError, match="not a faucet stream cursor"):
        parse_cursor('{"version": 9}', "s")
