"""The files source against real files in tmp_path: paging, bookmarks, shards, discovery, errors."""

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from faucet_dagster.protocol import (
    ConfigError,
    DataError,
    FaucetError,
    JsonValue,
    Ordering,
    Page,
    Role,
    SchemaError,
    Source,
    UnsupportedOperation,
    get_connector,
)


def build(**config: Any) -> Source:
    return get_connector("files").source(config)


def read(source: Source, batch_size: int) -> list[Page]:
    async def collect() -> list[Page]:
        return [page async for page in source.stream_pages({}, batch_size)]

    return asyncio.run(collect())


def ids(pages: Sequence[Page]) -> list[int]:
    out: list[int] = []
    for page in pages:
        assert isinstance(page.records, pa.RecordBatch)
        out.extend(page.records.column("id").to_pylist())
    return out


def write_csv(path: Path, first: int, count: int) -> None:
    lines = ["id,name,score"] + [f"{i},name {i},{i * 0.5}" for i in range(first, first + count)]
    path.write_text("\n".join(lines) + "\n")


def test_config_schema_is_valid_json_schema_and_building_does_no_io(tmp_path: Path) -> None:
    spec = get_connector("files")
    schema = spec.roles[Role.SOURCE].config_model.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    source = build(paths=[str(tmp_path / "nothing-here" / "*.csv")])
    assert source.connector_name == "files"
    with pytest.raises(ConfigError) as info:
        build(paths=["a.csv"], column_types={"x": "no-such-type"})
    assert "column_types" in str(info.value)


def test_csv_pages_are_bounded_ordered_and_never_span_files(tmp_path: Path) -> None:
    write_csv(tmp_path / "b.csv", 100, 25)
    write_csv(tmp_path / "a.csv", 0, 23)
    pages = read(build(paths=[str(tmp_path / "*.csv")]), 10)
    assert [page.num_rows for page in pages] == [10, 10, 3, 10, 10, 5]
    assert ids(pages) == list(range(23)) + list(range(100, 125))
    assert all(page.bookmark is not None for page in pages)
    last_of_a = pages[2].bookmark
    assert isinstance(last_of_a, dict)
    assert last_of_a["current"] is None and str(tmp_path / "a.csv") in last_of_a["completed"]  # type: ignore[operator]
    middle_of_b = pages[4].bookmark
    assert isinstance(middle_of_b, dict) and isinstance(middle_of_b["current"], dict)
    assert middle_of_b["current"]["path"] == str(tmp_path / "b.csv")
    assert middle_of_b["current"]["row"] == 20


def test_resume_from_every_page_bookmark_reads_exactly_the_rest(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 0, 17)
    write_csv(tmp_path / "b.csv", 17, 9)
    config = {"paths": [str(tmp_path / "*.csv")]}
    pages = read(build(**config), 4)
    everything = ids(pages)
    assert everything == list(range(26))
    delivered = 0
    for page in pages:
        delivered += page.num_rows
        resumed = build(**config)
        assert page.bookmark is not None
        resumed.apply_start_bookmark(json.loads(json.dumps(page.bookmark)))
        assert ids(read(resumed, 4)) == everything[delivered:]


def test_a_syncs_first_page_is_its_first_block_and_resumes_like_any_other(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 0, 3_000)
    write_csv(tmp_path / "b.csv", 3_000, 3_000)
    config = {"paths": [str(tmp_path / "*.csv")], "block_size": 4096}
    pages = read(build(**config), 1_000)
    sizes = [page.num_rows for page in pages]
    # The first page is out after one block (about 200 rows of 4 KiB), not a whole page: the
    # destination starts writing while the rest is parsed. Every later page is a whole one; the
    # second file starts with a whole page too.
    assert 0 < sizes[0] < 1_000 and sizes[1:4] == [1_000, 1_000, 1_000 - sizes[0]], sizes
    assert sizes[4:] == [1_000, 1_000, 1_000]
    assert ids(pages) == list(range(6_000))
    first = build(**config)
    assert pages[0].bookmark is not None
    first.apply_start_bookmark(json.loads(json.dumps(pages[0].bookmark)))
    assert ids(read(first, 1_000)) == list(range(sizes[0], 6_000))


def test_resume_moves_only_new_files_and_rereads_a_changed_one(tmp_path: Path) -> None:
    write_csv(tmp_path / "2024-01.csv", 0, 5)
    config = {"paths": [str(tmp_path / "*.csv")]}
    first = read(build(**config), 100)
    assert ids(first) == [0, 1, 2, 3, 4]
    bookmark = first[-1].bookmark
    assert bookmark is not None

    write_csv(tmp_path / "2024-02.csv", 5, 3)
    source = build(**config)
    source.apply_start_bookmark(bookmark)
    second = read(source, 100)
    assert ids(second) == [5, 6, 7]

    again = build(**config)
    assert second[-1].bookmark is not None
    again.apply_start_bookmark(second[-1].bookmark)
    assert read(again, 100) == []

    # A completed file whose content changed (size and mtime) is noticed and read again whole.
    write_csv(tmp_path / "2024-01.csv", 50, 6)
    changed = build(**config)
    changed.apply_start_bookmark(second[-1].bookmark)
    assert ids(read(changed, 100)) == list(range(50, 56))


def test_jsonl_and_parquet_stream_and_resume(tmp_path: Path) -> None:
    rows = [{"id": i, "tag": f"t{i % 3}", "ok": i % 2 == 0} for i in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=7)

    for name in ("rows.jsonl", "rows.parquet"):
        config = {"paths": [str(tmp_path / name)]}
        pages = read(build(**config), 6)
        assert ids(pages) == list(range(40)), name
        assert max(page.num_rows for page in pages) == 6
        assert isinstance(pages[0].records, pa.RecordBatch)
        assert pages[0].records.schema.field("ok").type == pa.bool_()
        resumed = build(**config)
        assert pages[2].bookmark is not None
        resumed.apply_start_bookmark(pages[2].bookmark)
        assert ids(read(resumed, 6)) == list(range(18, 40)), name


def test_batch_size_zero_is_one_page_and_fetch_returns_everything(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 0, 30)
    write_csv(tmp_path / "b.csv", 30, 30)
    config = {"paths": [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]}
    pages = read(build(**config), 0)
    assert len(pages) == 1 and ids(pages) == list(range(60))
    source = build(**config)
    records = asyncio.run(source.fetch({}))
    assert isinstance(records, pa.RecordBatch) and records.num_rows == 60
    bookmark = source.bookmark()
    assert isinstance(bookmark, dict) and len(bookmark["completed"]) == 2  # type: ignore[arg-type]


def test_columns_types_nulls_and_empty_strings(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text('id,name,amount\n1,"",2.50\n2,,3\n3,"a,""b""\nc",NULL\n')
    source = build(
        paths=[str(tmp_path / "t.csv")],
        columns=["name", "id", "amount"],
        column_types={"id": "int32", "amount": "decimal128(10, 2)"},
    )
    assert source.capabilities().columns == ("name", "id", "amount")
    (page,) = read(source, 10)
    assert isinstance(page.records, pa.RecordBatch)
    assert page.records.schema.names == ["name", "id", "amount"]
    assert page.records.schema.field("id").type == pa.int32()
    assert page.records.schema.field("amount").type == pa.decimal128(10, 2)
    assert page.records.column("name").to_pylist() == ["", None, 'a,"b"\nc']
    assert page.records.column("amount").to_pylist()[2] is None


def test_pages_stay_bounded_in_memory_on_a_large_csv(tmp_path: Path) -> None:
    path = tmp_path / "big.csv"
    count = 1_000_000
    numbers = pa.array(range(count), pa.int64())
    text = pc.binary_join_element_wise("some longer text value number ", pc.cast(numbers, pa.string()), "")
    pa_csv.write_csv(pa.table({"id": numbers, "text": text}), path)
    whole = path.stat().st_size
    del numbers, text
    source = build(paths=[str(path)], block_size=256 * 1024)
    baseline = pa.total_allocated_bytes()
    peak = 0
    rows = 0

    async def consume() -> None:
        nonlocal peak, rows
        async for page in source.stream_pages({}, 1000):
            assert page.num_rows <= 1000
            rows += page.num_rows
            peak = max(peak, pa.total_allocated_bytes() - baseline)

    asyncio.run(consume())
    assert rows == count
    # A whole-file read would hold about the file's size in Arrow data (> 40 MB); the streaming
    # reader holds its read-ahead blocks (a constant, about 10 MB at 256 KiB blocks) and two pages.
    assert whole > 40_000_000
    assert peak < whole / 3, (peak, whole)


def test_shards_are_the_files_and_a_shard_reads_only_its_file(tmp_path: Path) -> None:
    write_csv(tmp_path / "x1.csv", 0, 3)
    write_csv(tmp_path / "x2.csv", 10, 4)
    plain = build(paths=[str(tmp_path / "*.csv")])
    assert plain.capabilities().ordering is Ordering.STRICT_GLOBAL
    assert plain.capabilities().shardable is False
    with pytest.raises(UnsupportedOperation):
        asyncio.run(plain.enumerate_shards())

    config = {"paths": [str(tmp_path / "*.csv")], "shard_by_file": True}
    sharded = build(**config)
    caps = sharded.capabilities()
    assert caps.ordering is Ordering.PARTITION and caps.shardable and caps.page_bookmarks
    shards = asyncio.run(sharded.enumerate_shards())
    assert shards == [str(tmp_path / "x1.csv"), str(tmp_path / "x2.csv")]
    one = build(**config)
    one.apply_shard(shards[1])
    assert ids(read(one, 2)) == [10, 11, 12, 13]
    assert one.state_key() != build(**config).state_key()
    missing = build(**config)
    missing.apply_shard(str(tmp_path / "x9.csv"))
    with pytest.raises(ConfigError, match=r"x9\.csv"):
        read(missing, 2)


def test_discover_lists_files_with_their_schemas(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 0, 3)
    pq.write_table(pa.table({"k": pa.array([1], pa.int16())}), tmp_path / "b.parquet")
    source = build(paths=[str(tmp_path / "a.csv"), str(tmp_path / "b.parquet")])
    assert source.capabilities().discover
    found = {dataset.name: dataset for dataset in asyncio.run(source.discover())}
    assert set(found) == {str(tmp_path / "a.csv"), str(tmp_path / "b.parquet")}
    csv_schema = found[str(tmp_path / "a.csv")].schema
    assert csv_schema is not None and csv_schema.names == ["id", "name", "score"]
    assert csv_schema.field("score").type == pa.float64()
    parquet_schema = found[str(tmp_path / "b.parquet")].schema
    assert parquet_schema is not None and parquet_schema.field("k").type == pa.int16()
    assert found[str(tmp_path / "b.parquet")].details["format"] == "parquet"


def test_a_missing_file_or_an_unmatched_glob_is_a_config_error_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.csv")
    with pytest.raises(ConfigError) as info:
        read(build(paths=[missing]), 10)
    assert missing in str(info.value) and info.value.where == missing
    pattern = str(tmp_path / "none-*.parquet")
    with pytest.raises(ConfigError, match="none-"):
        asyncio.run(build(paths=[pattern]).check())


def test_a_corrupt_parquet_file_is_a_data_error_naming_it(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"id": list(range(100))}), good)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError) as info:
        read(build(paths=[str(corrupt)]), 10)
    assert str(corrupt) in str(info.value)
    assert isinstance(info.value, FaucetError)


def test_a_malformed_csv_is_a_data_error_naming_the_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("id,name\n" + "".join(f"{i},n{i}\n" for i in range(50)) + "51\n")
    with pytest.raises(DataError) as info:
        read(build(paths=[str(path)], block_size=4096), 10)
    assert str(path) in str(info.value)
    assert "Expected 2 columns" in str(info.value)
    assert info.value.details["file"] == str(path)


def test_a_missing_selected_column_is_a_schema_error(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 0, 2)
    with pytest.raises(SchemaError, match="nope"):
        read(build(paths=[str(tmp_path / "a.csv")], columns=["id", "nope"]), 10)


def test_a_foreign_bookmark_is_refused(tmp_path: Path) -> None:
    source = build(paths=[str(tmp_path / "a.csv")])
    bad: list[JsonValue] = [None, {"version": 99}, {"version": 1, "completed": {"a": [1]}}, "x"]
    for bookmark in bad:
        with pytest.raises(ConfigError):
            source.apply_start_bookmark(bookmark)
