"""Change messages decoded in bulk give exactly what the message-by-message decoder gives.

The oracle is :func:`faucet_postgres.pgoutput.decode`. Messages are generated (widths, nulls, any text,
bytes that are not UTF-8, and malformed messages: cut short, a wrong column count, a length past the
end, an unexpected marker), and a failure shrinks to the smallest batch that shows it.
"""

import struct

import pyarrow as pa
import pytest
from faucet_postgres import pgoutput as pg
from faucet_postgres.cdc_rows import DELETE, INSERT, UPDATE, Rows, Table
from faucet_postgres.pgoutput_columns import tuple_columns
from hypothesis import given, settings
from hypothesis import strategies as st

from faucet_dagster.protocol import UNCHANGED_COLUMN, IntegrityError

RELATION = 16_384

Value = str | bytes | None
"""A column's value: a text, raw bytes (maybe not UTF-8), or null."""


def message(values: list[Value], *, count: int | None = None, marker: bytes | None = None) -> bytes:
    """An Insert message of ``values``; ``count`` overrides the declared column count, ``marker`` the
    first column's marker ('u' for an unchanged TOASTed value, 'b' for a binary one)."""
    body = b""
    for index, value in enumerate(values):
        if index == 0 and marker is not None:
            body += marker + (b"" if marker == b"u" else struct.pack(">I", 1) + b"x")
        elif value is None:
            body += b"n"
        else:
            raw = value.encode() if isinstance(value, str) else value
            body += b"t" + struct.pack(">I", len(raw)) + raw
    declared = len(values) if count is None else count
    return b"I" + struct.pack(">I", RELATION) + b"N" + struct.pack(">H", declared) + body


def reference(messages: list[bytes]) -> list[tuple[str | None, ...]] | None:
    """What the message-by-message decoder gives (None: one of them does not decode)."""
    rows = []
    for data in messages:
        try:
            decoded = pg.decode(data)
        except IntegrityError:
            return None
        assert isinstance(decoded, pg.Insert)
        rows.append(decoded.new.values)
    return rows


values = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.binary(max_size=6),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40),
)


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[bytes], int | None]:
    """A width, Insert messages of that width, and the one that is damaged (None: none is)."""
    width = draw(st.integers(0, 5))
    count = draw(st.integers(1, 25))
    messages = [message(draw(st.lists(values, min_size=width, max_size=width))) for _ in range(count)]
    malformed = draw(st.booleans())
    if malformed:
        index = draw(st.integers(0, count - 1))
        row = draw(st.lists(values, min_size=max(width, 1), max_size=max(width, 1)))
        damage = draw(st.sampled_from(["cut", "count", "length", "marker_b", "marker_u"]))
        if damage == "cut":
            whole = message(row)
            messages[index] = whole[: draw(st.integers(0, len(whole) - 1))]
        elif damage == "count":
            messages[index] = message(row, count=draw(st.integers(0, 7).filter(lambda c: c != len(row))))
        elif damage == "length":
            whole = bytearray(message([*row[:-1], "long enough"]))
            last = len(whole) - len(b"long enough") - 4
            whole[last : last + 4] = struct.pack(">I", len(b"long enough") + draw(st.integers(1, 50)))
            messages[index] = bytes(whole)
        else:
            messages[index] = message(row, marker=b"b" if damage == "marker_b" else b"u")
    return width, messages, index if malformed else None


def columns_as_rows(columns: list[pa.Array], count: int) -> list[tuple[str | None, ...]]:
    return list(zip(*(column.to_pylist() for column in columns), strict=True)) if columns else [()] * count


def decoded_alone(data: bytes, width: int) -> tuple[str | None, ...] | None:
    """What the decoder gives for one message of a ``width``-column table (None: it refuses it, or
    the message declares another column count)."""
    try:
        decoded = pg.decode(data)
    except IntegrityError:
        return None
    assert isinstance(decoded, pg.Insert)
    return decoded.new.values if len(decoded.new.values) == width else None


@settings(max_examples=400, deadline=None)
@given(batches())
def test_bulk_decoding_gives_the_decoders_texts_or_leaves_the_message_out(
    case: tuple[int, list[bytes], int | None],
) -> None:
    width, messages, damaged = case
    alone = [decoded_alone(data, width) for data in messages]
    found = tuple_columns(messages, width)
    if found is None:
        # The whole batch declined: only for a value that is not UTF-8, which the decoder refuses.
        assert any(values is None for values in alone), "declined a batch the decoder reads"
        return
    columns, bulk = found
    assert len(bulk) == len(messages)
    for index, values in enumerate(alone):
        if values is None:
            # The decoder refuses it (or it is not the table's width): left out, for the caller to
            # decode on its own and raise the decoder's error.
            assert not bulk[index], f"message {index} decoded in bulk, the decoder refuses it"
        elif not bulk[index]:
            # Leaving out what the decoder reads is allowed only for a damaged message it still reads
            # (an unchanged-value marker, which never comes in an insert).
            assert index == damaged, f"well-formed message {index} left out"
    assert all(len(column) == int(bulk.sum()) for column in columns)
    kept = [values for values, taken in zip(alone, bulk, strict=True) if taken]
    assert columns_as_rows(columns, len(kept)) == kept


def test_well_formed_inserts_are_decoded_in_bulk_not_declined() -> None:
    rows: list[list[Value]] = [["1", None, "été ✓"], [None, None, None], ["", "x" * 300, "\x00"]]
    messages = [message(row) for row in rows]
    found = tuple_columns(messages, 3)
    assert found is not None
    columns, bulk = found
    assert bulk.all()
    assert columns_as_rows(columns, 3) == reference(messages)


def test_a_table_batch_merges_encoded_and_decoded_rows_in_their_order() -> None:
    """Rows kept encoded and rows decoded already (updates, deletes) come out in buffer order."""
    relation = pg.Relation(
        RELATION, "public", "t", "d", (pg.Column("id", 20, -1, True), pg.Column("note", 25, -1, False))
    )
    table = Table(relation, True, (0,))
    rows = Rows()
    for index in range(12):
        texts = (str(index), None if index % 3 else f"note {index}")
        rows.values.append(message(list(texts)) if index % 2 else texts)
        rows.operations.append(INSERT)
        rows.unchanged.append(None)
    batch = table.batch(rows)
    assert batch.column("id").to_pylist() == list(range(12))
    assert batch.column("note").to_pylist() == [None if i % 3 else f"note {i}" for i in range(12)]


def test_a_malformed_encoded_insert_raises_the_decoders_error_from_its_batch() -> None:
    relation = pg.Relation(RELATION, "public", "t", "d", (pg.Column("note", 25, -1, False),))
    table = Table(relation, True, (0,))
    rows = Rows()
    rows.values.extend([message(["fine"]), message(["cut short"])[:-3]])
    rows.operations.extend([INSERT, INSERT])
    rows.unchanged.extend([None, None])
    with pytest.raises(IntegrityError, match="malformed"):
        table.batch(rows)


def test_an_update_that_left_a_value_out_is_decoded_alone_and_names_it() -> None:
    """An update's 'u' marker (a TOASTed value it left unchanged) is left out by bulk decoding; the
    batch decodes that message alone and names the column, as a decoded update's row does."""
    relation = pg.Relation(
        RELATION, "public", "t", "d", (pg.Column("id", 20, -1, True), pg.Column("doc", 25, -1, False))
    )
    table = Table(relation, True, (0,))
    untouched = b"U" + message(["7", None])[1:]  # an update without an old image, same layout
    left_out = bytearray(b"U" + message(["8", None])[1:])
    left_out[-1:] = b"u"  # the second column: unchanged
    deleted = b"D" + message(["9", None])[1:5] + b"K" + message(["9", None])[6:]
    # Only that message is left out of bulk decoding, not its batch.
    found = tuple_columns([untouched, bytes(left_out), deleted], 2)
    assert found is not None
    assert found[1].tolist() == [True, False, True]
    rows = Rows()
    rows.values.extend([untouched, bytes(left_out), deleted, ("10", "text")])
    rows.operations.extend([UPDATE, UPDATE, DELETE, INSERT])
    rows.unchanged.extend([None, None, None, None])
    batch = table.batch(rows)
    assert batch.column("id").to_pylist() == [7, 8, 9, 10]
    assert batch.column("doc").to_pylist() == [None, None, None, "text"]
    assert batch.column(UNCHANGED_COLUMN).to_pylist() == [None, ["doc"], None, None]
