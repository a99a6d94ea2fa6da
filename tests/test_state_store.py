"""The state store on SQLite and on the real PostgreSQL: certificates, leases, report marks, the CLI."""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from faucet_dagster.cli.main import main
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    DomainCoverage,
    EpochCertificate,
    EventIdentity,
    IncarnationChanged,
    IntegrityError,
    OrderingDomain,
    OwnershipLost,
    Receipt,
    RejectedRecord,
    UncertainOutcome,
)
from faucet_dagster.state import Lease, LeaseBusy, StateStore, default_state_url

DOMAIN = OrderingDomain("nats", "orders", "0", "2024-01-01T00:00:00Z/1", "nats.stream_sequence")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'home' / 'faucet_state.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[StateStore]:
    opened = StateStore(store_url)
    yield opened
    opened.close()


def certificate(lease: Lease, sequence: int, start: str | None, end: str, rows: int = 10) -> EpochCertificate:
    return EpochCertificate(
        stream=lease.stream,
        sequence=sequence,
        fencing_token=lease.fencing_token,
        worker=lease.owner,
        coverage=(DomainCoverage(DOMAIN, start, end),),
        receipts=(Receipt("orders", rows),),
        row_counts={"orders": rows},
        digest="blake2b-256:00",
        delivery=Delivery.EFFECTIVELY_ONCE,
        timings={"commit": 0.01},
    )


def test_certificates_chain_through_the_codecs(store: StateStore) -> None:
    lease = store.acquire_lease("orders", "w1", 30)
    assert store.append_certificate(certificate(lease, 1, None, "10"), lease) is True
    assert store.append_certificate(certificate(lease, 2, "10", "25"), lease) is True
    assert [c.sequence for c in store.certificates("orders")] == [1, 2]
    assert [p.value for p in store.certified_positions("orders")] == ["25"]
    last = store.last_certificate("orders")
    assert last is not None and last.coverage[0].end == "25" and last.row_counts == {"orders": 10}


def test_a_retried_identical_certificate_is_accepted_and_a_conflicting_one_refused(store: StateStore) -> None:
    lease = store.acquire_lease("orders", "w1", 30)
    first = certificate(lease, 1, None, "10")
    assert store.append_certificate(first, lease) is True
    retried = EpochCertificate(**{**first.__dict__, "timings": {"commit": 9.0}, "created_at": "later"})
    assert store.append_certificate(retried, lease) is False
    with pytest.raises(IntegrityError, match="conflicts"):
        store.append_certificate(certificate(lease, 1, None, "11"), lease)
    assert len(store.certificates("orders")) == 1


def test_a_regression_or_a_gap_is_refused(store: StateStore) -> None:
    lease = store.acquire_lease("orders", "w1", 30)
    store.append_certificate(certificate(lease, 1, None, "10"), lease)
    with pytest.raises(IntegrityError, match="goes back before"):
        store.append_certificate(certificate(lease, 2, "5", "8"), lease)
    with pytest.raises(IntegrityError, match="goes back from"):
        store.append_certificate(certificate(lease, 2, "10", "9"), lease)
    with pytest.raises(IntegrityError, match="does not start at"):
        store.append_certificate(certificate(lease, 2, "12", "20"), lease)
    with pytest.raises(IntegrityError, match="does not follow"):
        store.append_certificate(certificate(lease, 3, "10", "20"), lease)
    with pytest.raises(IntegrityError, match="invalid position"):
        store.append_certificate(certificate(lease, 2, "10", "0020"), lease)
    recreated = OrderingDomain(
        DOMAIN.source, DOMAIN.resource, DOMAIN.partition, "2025-01-01T00:00:00Z/1", DOMAIN.codec
    )
    other = certificate(lease, 2, None, "3")
    with pytest.raises(IncarnationChanged):
        store.append_certificate(
            EpochCertificate(**{**other.__dict__, "coverage": (DomainCoverage(recreated, None, "3"),)}), lease
        )
    assert [c.sequence for c in store.certificates("orders")] == [1]


def test_only_the_live_lease_holder_certifies(store: StateStore) -> None:
    old = store.acquire_lease("orders", "w1", 0.3)
    time.sleep(0.4)
    new = store.acquire_lease("orders", "w2", 30)
    assert new.fencing_token == old.fencing_token + 1
    with pytest.raises(OwnershipLost, match="leased to w2"):
        store.append_certificate(certificate(old, 1, None, "10"), old)
    with pytest.raises(OwnershipLost):
        store.append_certificate(certificate(old, 1, None, "10"), new)
    assert store.append_certificate(certificate(new, 1, None, "10"), new)


def test_leases_are_compare_and_set_with_growing_fencing_tokens(store: StateStore) -> None:
    first = store.acquire_lease("orders", "w1", 30)
    assert store.acquire_lease("orders", "w1", 30).fencing_token == first.fencing_token  # a renewal
    with pytest.raises(OwnershipLost, match="leased to w1"):
        store.acquire_lease("orders", "w2", 30)
    renewed = store.renew_lease(first, 0.3)
    store.check_lease(renewed)
    time.sleep(0.4)
    with pytest.raises(OwnershipLost, match="expired"):
        store.check_lease(renewed)
    with pytest.raises(OwnershipLost):
        store.renew_lease(renewed, 30)
    second = store.acquire_lease("orders", "w2", 30)
    assert second.fencing_token == first.fencing_token + 1
    assert store.release_lease(first) is False
    assert store.release_lease(second) is True
    third = store.acquire_lease("orders", "w3", 30)
    assert third.fencing_token == second.fencing_token + 1


def test_concurrent_acquires_grant_one_lease(store: StateStore) -> None:
    winners: list[Lease] = []
    losers: list[OwnershipLost] = []

    def contend(owner: str) -> None:
        try:
            winners.append(store.acquire_lease("orders", owner, 30))
        except OwnershipLost as exc:
            losers.append(exc)

    threads = [threading.Thread(target=contend, args=(f"w{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and len(losers) == 5
    assert winners[0].fencing_token == 1


def test_an_uncertain_stream_is_not_leased_until_released(
    store: StateStore, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = store.acquire_lease("orders", "w1", 30)
    store.mark_uncertain("orders", "close timed out with a COPY in flight")
    with pytest.raises(OwnershipLost, match="uncertain"):
        store.check_lease(lease)
    for owner in ("w1", "w2"):
        with pytest.raises(UncertainOutcome, match="faucet streams release orders"):
            store.acquire_lease("orders", owner, 30)
    assert main(["streams", "status", "--state-url", store_url]) == 0
    assert "uncertain: yes: close timed out" in capsys.readouterr().out
    assert main(["streams", "release", "orders", "--state-url", store_url]) == 0
    assert "marked uncertain (close timed out" in capsys.readouterr().out
    taken = store.acquire_lease("orders", "w2", 30)
    assert taken.fencing_token == lease.fencing_token + 1
    assert main(["streams", "status", "orders", "--json", "--state-url", store_url]) == 0
    [status] = json.loads(capsys.readouterr().out)
    assert status["owner"] == "w2" and status["uncertain"] is False and status["lease_live"] is True


def test_release_refuses_a_live_lease_that_is_not_uncertain_unless_forced(
    store: StateStore, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Releasing a stream a live worker holds would let a second worker write beside it: refused (exit
    1, nothing changed) unless --force; an expired or uncertain one is released as before."""
    lease = store.acquire_lease("orders", "w1", 30)
    assert main(["streams", "release", "orders", "--state-url", store_url]) == 1
    assert "not released: orders is not marked uncertain and w1 holds a live lease" in capsys.readouterr().err
    store.check_lease(lease)  # still held
    assert main(["streams", "release", "orders", "--force", "--state-url", store_url]) == 0
    assert "leased to w1" in capsys.readouterr().out
    with pytest.raises(OwnershipLost):
        store.check_lease(lease)
    expired = store.acquire_lease("orders", "w2", 0.001)
    deadline = time.monotonic() + 60
    while store.status("orders")[0].lease_live:  # the lease's end, as the store's clock sees it
        assert time.monotonic() < deadline, "a lease of a millisecond is still live after a minute"
        time.sleep(0.05)
    assert main(["streams", "release", "orders", "--state-url", store_url]) == 0
    with pytest.raises(OwnershipLost):
        store.check_lease(expired)


def test_report_marks_never_go_back(store: StateStore) -> None:
    assert store.reported_through("orders") == 0
    store.mark_reported("orders", 5)
    store.mark_reported("orders", 3)
    assert store.reported_through("orders") == 5


def test_status_of_an_unknown_stream_is_a_config_error(store: StateStore, store_url: str) -> None:
    with pytest.raises(ConfigError, match="no stream 'missing'"):
        store.status("missing")
    assert main(["streams", "release", "missing", "--state-url", store_url]) == 2


def test_the_default_store_is_a_sqlite_file_under_dagster_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FAUCET_STATE_URL", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    with pytest.raises(ConfigError, match="DAGSTER_HOME"):
        default_state_url()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    store = StateStore()
    store.acquire_lease("orders", "w1", 30)
    store.close()
    assert (tmp_path / "dagster" / "faucet_state.db").is_file()
    with pytest.raises(ConfigError, match="SQLite and PostgreSQL"):
        StateStore("mysql://localhost/x")


def test_a_newer_worker_asks_the_live_holder_to_hand_over_and_an_older_one_does_not(
    store: StateStore, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    held = store.acquire_lease("s", "old", 30, started=100.0)
    assert store.handover_requested(held) is None
    # An older worker (a second live process that started earlier) neither takes nor asks.
    busy = store.try_acquire_lease("s", "older", 30, started=50.0)
    assert isinstance(busy, LeaseBusy) and busy.owner == "old" and not busy.handover_requested
    assert store.handover_requested(held) is None
    # A newer one (the process a deployment replaces the holder with) asks; the holder sees it.
    busy = store.try_acquire_lease("s", "new", 30, started=200.0)
    assert isinstance(busy, LeaseBusy) and busy.handover_requested and 29 < busy.seconds_left <= 30
    assert store.handover_requested(held) == "new"
    assert store.status("s")[0].handover_to == "new"
    capsys.readouterr()
    assert main(["streams", "status", "s", "--state-url", store_url]) == 0
    assert "asked to hand over to new" in capsys.readouterr().out
    with pytest.raises(OwnershipLost, match="asked to hand the stream over"):
        store.acquire_lease("s", "new", 30, started=200.0)
    # The holder renews while it closes, then passes the lease on: the stream cannot fall back to it
    # (or to any other worker); the newer worker takes it, fenced.
    held = store.renew_lease(held, 30)
    assert store.hand_over(held, 30) == "new"
    assert store.hand_over(held, 30) is None and not store.release_lease(held)  # no longer held
    for other in ("old", "older"):
        assert isinstance(store.try_acquire_lease("s", other, 30, started=50.0), LeaseBusy)
    taken = store.try_acquire_lease("s", "new", 30, started=200.0)
    assert isinstance(taken, Lease) and taken.fencing_token == held.fencing_token + 1
    assert store.handover_requested(taken) is None and store.status("s")[0].handover_to is None
    with pytest.raises(OwnershipLost):
        store.check_lease(held)


def test_a_store_of_an_earlier_version_gets_the_new_lease_columns(store_url: str) -> None:
    url = store_url
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:  # faucet_streams as the first release created it, with a lease
        conn.exec_driver_sql(
            "CREATE TABLE faucet_streams (stream VARCHAR(255) PRIMARY KEY, lease_owner VARCHAR(255), "
            "fencing_token BIGINT NOT NULL, lease_expires FLOAT, uncertain BOOLEAN NOT NULL, "
            "uncertain_reason TEXT, reported_through BIGINT NOT NULL)"
        )
        conn.exec_driver_sql("INSERT INTO faucet_streams VALUES ('s', 'old', 4, 0, false, NULL, 7)")
    engine.dispose()
    with StateStore(url) as store:
        status = store.status("s")[0]
        assert (status.owner, status.fencing_token, status.reported_through) == ("old", 4, 7)
        lease = store.acquire_lease("s", "new", 30, started=1.0)  # the old lease has expired
        assert lease.fencing_token == 5
    with StateStore(url) as again:  # opening a migrated store changes nothing
        assert again.status("s")[0].owner == "new"


def letters(*offsets: int) -> list[RejectedRecord]:
    return [
        RejectedRecord(EventIdentity(DOMAIN, str(offset)), "refused", b"{}", f"orders @ {offset}", "orders")
        for offset in offsets
    ]


def test_a_zombie_withdraws_only_the_dead_letters_it_routed_not_its_successors(store: StateStore) -> None:
    # Owner 1 (now a zombie) and owner 2 both routed epoch 3's refused rows 5 and 6; owner 2 also 7.
    store.record_dead_letters("s", 3, 1, letters(5, 6))
    store.record_dead_letters("s", 3, 2, letters(5, 6, 7))  # owner 2 takes 5 and 6 over
    store.record_dead_letters("s", 3, 1, letters(5))  # an older owner never takes one back
    # The zombie's commit is fenced: its abort withdraws what it routed, which owner 2 now holds.
    assert store.withdraw_dead_letters("s", 1, letters(5, 6)) == 0
    assert [(row["event"], row["fencing_token"]) for row in store.dead_letters("s")] == [
        (f"{DOMAIN.key()}@{offset}#0", 2) for offset in (5, 6, 7)
    ]
    assert store.withdraw_dead_letters("s", 2, letters(7)) == 1


def test_a_new_owner_discards_the_dead_letters_of_epochs_that_never_committed(store: StateStore) -> None:
    store.record_dead_letters("s", 4, 1, letters(1))  # epoch 4: committed
    store.record_dead_letters("s", 5, 1, letters(2))  # epoch 5: its owner died before committing
    store.record_dead_letters("s", 5, 2, letters(3))  # the new owner's own epoch 5 (an earlier attempt)
    assert store.discard_uncommitted_dead_letters("s", 4, 2) == 1
    assert [row["event"] for row in store.dead_letters("s")] == [
        f"{DOMAIN.key()}@1#0",
        f"{DOMAIN.key()}@3#0",
    ]
