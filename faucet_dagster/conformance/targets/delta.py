"""Delta Lake: the bounded sink and the streaming sink, on fresh tables per check: local folders,
or a bucket on the S3 endpoint.

Rows are read back through delta-rs (``DeltaTable.to_pyarrow_table``) as any reader of the table
would. The refused rows are refused by a CHECK constraint on ``name``'s length, added to the table
when it is created (Delta's table constraints, checked by every writer).
"""

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from faucet_dagster.conformance.options import ConformanceOptions
from faucet_dagster.conformance.setup import SinkSetup
from faucet_dagster.conformance.targets._common import NAME_LIMIT, closed_port, refused_rows, with_mode
from faucet_dagster.testing import S3Server

Options = dict[str, str] | None
"""delta-rs's storage options of a table (None: a local folder)."""

DELTA_STREAMING_OPTIONS = ConformanceOptions(
    effects=frozenset(
        f"deltalake._internal:{call}"
        for call in ("write_to_deltalake", "RawDeltaTable.write", "RawDeltaTable.merge_execute")
    )
)
"""The streaming sink's battery options: delta-rs's calls that commit to the table's log are the
effects the generated scenarios crash a worker right before."""


def _create_items(uri: str, options: Options) -> None:
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    empty = pa.table({"id": pa.array([], pa.int64()), "name": pa.array([], pa.string())})
    write_deltalake(uri, empty, storage_options=options)
    constraint = {"name_fits": f"character_length(name) <= {NAME_LIMIT}"}
    DeltaTable(uri, storage_options=options).alter.add_constraint(constraint)


def _reader(uri: str, options: Options) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
    def read() -> list[dict[str, Any]]:
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(uri, storage_options=options):
            return []
        rows: list[dict[str, Any]] = DeltaTable(uri, storage_options=options).to_pyarrow_table().to_pylist()
        return rows

    async def read_back() -> list[dict[str, Any]]:
        return await asyncio.to_thread(read)

    return read_back


def _setup(
    root: str, extra: Mapping[str, Any], options: Options, unreachable: Mapping[str, Any]
) -> SinkSetup:
    items, keyed = f"{root}/items", f"{root}/items_keyed"
    _create_items(items, options)
    return SinkSetup(
        {"uri": items, "mode": "append", **extra},
        _reader(items, options),
        keyed_config={"uri": keyed, "mode": "upsert", "key": ["id"], **extra},
        read_keyed=_reader(keyed, options),
        refused_rows=refused_rows(),
        unreachable=unreachable,
        configure=with_mode({"uri": items, **extra}),
    )


def delta_sink(tmp_path: Path) -> SinkSetup:
    """``items`` (name at most 40 characters) appended to with the watermark; ``items_keyed`` merged."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    unreachable = {"uri": str(blocker / "items"), "mode": "append"}
    return _setup(str(tmp_path / "lake"), {}, None, unreachable)


def _s3_table(s3_server: S3Server, unique_name: Callable[..., str]) -> tuple[str, dict[str, Any], Options]:
    """A new bucket of the S3 endpoint: its ``s3://`` root, the sink's ``s3`` block and delta-rs's
    storage options for reading it back."""
    bucket = s3_server.create_bucket(unique_name("lake").replace("_", "-"))
    s3 = {
        "endpoint_url": s3_server.endpoint_url,
        "region": s3_server.region,
        "access_key_id": s3_server.access_key_id,
        "secret_access_key": s3_server.secret_access_key,
        "allow_http": s3_server.endpoint_url.startswith("http://"),
    }
    options = {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_REGION": s3_server.region,
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        "AWS_ALLOW_HTTP": "true",
    }
    return f"s3://{bucket}/lake", s3, options


def _closed_endpoint(s3: Mapping[str, Any]) -> dict[str, Any]:
    return {**s3, "endpoint_url": f"http://127.0.0.1:{closed_port()}", "allow_http": True}


def delta_s3_sink(s3_server: S3Server, unique_name: Callable[..., str]) -> SinkSetup:
    """:func:`delta_sink` in a new bucket of the S3 endpoint; unreachable: an endpoint nobody answers."""
    root, s3, options = _s3_table(s3_server, unique_name)
    unreachable = {"uri": f"{root}/items", "mode": "append", "s3": _closed_endpoint(s3)}
    return _setup(root, {"s3": s3}, options, unreachable)


def _streaming_setup(
    items: str, extra: Mapping[str, Any], options: Options, unreachable: Mapping[str, Any]
) -> SinkSetup:
    _create_items(items, options)
    return SinkSetup(
        {"uri": items, **extra},
        _reader(items, options),
        refused_rows=refused_rows(),
        unreachable=unreachable,
    )


def delta_streaming_sink(tmp_path: Path) -> SinkSetup:
    """Epochs into ``items`` (name at most 40 characters), one Delta commit each."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    return _streaming_setup(str(tmp_path / "lake" / "items"), {}, None, {"uri": str(blocker / "items")})


def delta_s3_streaming_sink(s3_server: S3Server, unique_name: Callable[..., str]) -> SinkSetup:
    """:func:`delta_streaming_sink` in a new bucket of the S3 endpoint; unreachable: an endpoint nobody
    answers."""
    root, s3, options = _s3_table(s3_server, unique_name)
    unreachable = {"uri": f"{root}/items", "s3": _closed_endpoint(s3)}
    return _streaming_setup(f"{root}/items", {"s3": s3}, options, unreachable)
