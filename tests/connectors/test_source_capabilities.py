"""Every shipped source declares ``discover`` and ``shardable`` only where the methods exist.

Offline: building a connector never connects. A bounded source that declares ``discover`` overrides
``Source.discover``, one that declares ``shardable`` overrides ``enumerate_shards`` and
``apply_shard`` (what they return is tested against the real servers in each connector's tests:
``test_files_source``, ``test_sql_connector``, ``test_postgres_bounded``, ``test_kafka_source``);
one that does not declare them keeps the defaults, which raise UnsupportedOperation. A stream
source has neither method in the streaming contract (a stream is divided among workers by
membership), so it never declares them. ``deterministic`` is backed where it is used, by the
crash-and-rerun tests of ``tests/test_runner_bounded.py`` and the conformance battery's re-read.
"""

from pathlib import Path
from typing import Any

import pytest

from faucet_dagster.protocol import Source, StreamSource, UnsupportedOperation, get_connector
from faucet_dagster.runner.sync import run_sync

PG = "postgresql://faucet@localhost:5432/db"


def bounded_configs(tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    data = tmp_path / "a.csv"
    data.write_text("id\n1\n")
    return [
        ("files", {"paths": [str(data)]}),
        ("files", {"paths": [str(data)], "shard_by_file": True}),
        ("sql", {"url": f"sqlite:///{tmp_path / 'x.db'}", "table": "t"}),
        ("postgres", {"url": PG, "table": "t"}),
        ("kafka", {"bootstrap_servers": "localhost:9092", "topics": ["t"], "group_id": "g"}),
        ("nats", {"servers": ["nats://localhost:4222"], "stream": "s"}),
    ]


STREAM_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("kafka", {"bootstrap_servers": "localhost:9092", "topics": ["t"], "group_id": "g"}),
    ("nats", {"servers": ["nats://localhost:4222"], "stream": "s"}),
    ("postgres", {"url": PG, "slot": "s", "publication": "p", "tables": ["public.t"]}),
]


def overrides(source: Source, name: str) -> bool:
    return getattr(type(source), name) is not getattr(Source, name)


def test_bounded_sources_declare_discover_and_shardable_only_with_the_methods(tmp_path: Path) -> None:
    for connector, config in bounded_configs(tmp_path):
        source = get_connector(connector).source(config)
        caps = source.capabilities()
        where = f"{connector} {config}"
        if caps.discover:
            assert overrides(source, "discover"), where
        else:
            with pytest.raises(UnsupportedOperation):
                run_sync(source.discover())
        if caps.shardable:
            assert overrides(source, "enumerate_shards") and overrides(source, "apply_shard"), where
        else:
            with pytest.raises(UnsupportedOperation):
                run_sync(source.enumerate_shards())
            with pytest.raises(UnsupportedOperation):
                source.apply_shard("any")


@pytest.mark.parametrize(("connector", "config"), STREAM_CONFIGS, ids=[c for c, _ in STREAM_CONFIGS])
def test_stream_sources_never_declare_discover_or_shardable(connector: str, config: dict[str, Any]) -> None:
    source = get_connector(connector).stream_source(config)
    assert isinstance(source, StreamSource)
    caps = source.capabilities()
    assert not hasattr(source, "discover") and not hasattr(source, "enumerate_shards")
    assert not caps.discover and not caps.shardable
