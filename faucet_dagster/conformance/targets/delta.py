"""Delta Lake: the bounded sink and the streaming sink, on fresh local tables per check.

Rows are read back through delta-rs (``DeltaTable.to_pyarrow_table``) as any reader of the table
would. The refused rows are refused by a CHECK constraint on ``name``'s length, added to the table
when it is created (Delta's table constraints, checked by every writer).
"""

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from faucet_dagster.conformance.options import ConformanceOptions
from faucet_dagster.conformance.setup import SinkSetup
from faucet_dagster.conformance.targets._common import NAME_LIMIT, refused_rows, with_mode

DELTA_STREAMING_OPTIONS = ConformanceOptions(
    effects=frozenset(
        f"deltalake._internal:{call}"
        for call in ("write_to_deltalake", "RawDeltaTable.write", "RawDeltaTable.merge_execute")
    )
)
"""The streaming sink's battery options: delta-rs's calls that commit to the table's log are the
effects the generated scenarios crash a worker right before."""


def _create_items(path: Path) -> None:
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    empty = pa.table({"id": pa.array([], pa.int64()), "name": pa.array([], pa.string())})
    write_deltalake(str(path), empty)
    DeltaTable(str(path)).alter.add_constraint({"name_fits": f"character_length(name) <= {NAME_LIMIT}"})


def _reader(path: Path) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
    def read() -> list[dict[str, Any]]:
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(str(path)):
            return []
        rows: list[dict[str, Any]] = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
        return rows

    async def read_back() -> list[dict[str, Any]]:
        return await asyncio.to_thread(read)

    return read_back


def delta_sink(tmp_path: Path) -> SinkSetup:
    """``items`` (name at most 40 characters) appended to with the watermark; ``items_keyed`` merged."""
    items, keyed = tmp_path / "lake" / "items", tmp_path / "lake" / "items_keyed"
    _create_items(items)
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    return SinkSetup(
        {"uri": str(items), "mode": "append"},
        _reader(items),
        keyed_config={"uri": str(keyed), "mode": "upsert", "key": ["id"]},
        read_keyed=_reader(keyed),
        refused_rows=refused_rows(),
        unreachable={"uri": str(blocker / "items"), "mode": "append"},
        configure=with_mode({"uri": str(items)}),
    )


def delta_streaming_sink(tmp_path: Path) -> SinkSetup:
    """Epochs into ``items`` (name at most 40 characters), one Delta commit each."""
    items = tmp_path / "lake" / "items"
    _create_items(items)
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    return SinkSetup(
        {"uri": str(items)},
        _reader(items),
        refused_rows=refused_rows(),
        unreachable={"uri": str(blocker / "items")},
    )
