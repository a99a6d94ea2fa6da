"""A table's pgoutput change messages decoded in bulk, straight into Arrow text columns.

:func:`faucet_postgres.pgoutput.decode` builds, per message, a message tuple, its tuple data and a
Python string per value, which :class:`faucet_postgres.cdc_rows.Table` then turns column by column into
Arrow: in a change stream most of a read's time. Here the messages of one batch are laid end to end
in one buffer, and each column is cut out of it with array operations (NumPy) into an Arrow string
array: no Python object per value. The result is exactly the texts ``decode`` gives (a property test
compares them on generated messages). A message this cannot decode so (malformed, or a column marker
other than text or null: an update's unchanged TOASTed value) is left out and named, and the caller
decodes it on its own, which raises the precise :class:`IntegrityError` or names the unchanged column;
a value that is not UTF-8 makes the caller decode the whole batch message by message.

The messages whose one tuple starts at the same place (PostgreSQL documentation, "Logical Replication
Message Formats"): an insert, an update that carries no old image (its key did not change), a delete
(its old key, or its old row under REPLICA IDENTITY FULL)::

    'I' | 'U' | 'D'  Int32 relation OID  'N' | 'K' | 'O'  Int16 column count  ('n' | 't' Int32 length bytes)*

Their type and tuple markers are the caller's to check; this module reads the tuple.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

TUPLE_START = 6
"""Where the tuple data starts: after the message type, the relation OID and the tuple marker."""
_TEXT, _NULL = 0x74, 0x6E
_MAX_OFFSET = 2**31 - 1
"""The largest offset of an Arrow string array (int32 offsets)."""

Positions = npt.NDArray[np.int64]


def tuple_width(message: bytes) -> int:
    """The column count a change message's tuple declares (its Int16 header)."""
    return (message[TUPLE_START] << 8) | message[TUPLE_START + 1]


def tuple_columns(
    messages: Sequence[bytes], width: int
) -> tuple[list[pa.Array], npt.NDArray[np.bool_]] | None:
    """The ``width`` columns of ``messages`` (change messages of one relation, each with one tuple of
    ``width`` columns at :data:`TUPLE_START`) as Arrow string arrays, a value's text or null, and
    which messages they hold: ``bulk[i]`` is False for a message this cannot decode so (cut short,
    another column count, a length past its end, a marker other than text or null: an update's 'u'
    for an unchanged TOASTed value), which the caller decodes on its own (raising the precise error,
    or naming the unchanged columns); the columns hold the other messages, in order. None (decode
    every message one by one) when a value is not UTF-8, or the texts overflow one Arrow array."""
    count = len(messages)
    buffer = np.frombuffer(b"".join(messages), dtype=np.uint8)
    lengths = np.fromiter(map(len, messages), dtype=np.int64, count=count)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    bulk = lengths >= TUPLE_START + 2
    if not bool(bulk.any()):
        return [pa.array([], pa.string()) for _ in range(width)], bulk
    header = np.where(bulk, starts + TUPLE_START, 0)  # a short message's header is not read
    declared = (buffer[header].astype(np.int64) << 8) | buffer[header + 1]
    bulk &= declared == width
    position = starts + TUPLE_START + 2
    columns: list[pa.Array] = []
    for _ in range(width):
        column = _column(buffer, position, ends, bulk)
        if column is None:
            return None
        array, position, bulk = column
        columns.append(array)
    if not bool(bulk.all()):
        keep = pa.array(bulk)
        columns = [column.filter(keep) for column in columns]
    return columns, bulk


def _column(
    buffer: npt.NDArray[np.uint8], position: Positions, ends: Positions, bulk: npt.NDArray[np.bool_]
) -> tuple[pa.Array, Positions, npt.NDArray[np.bool_]] | None:
    """The column whose markers are at ``position`` (one per message; ``bulk``: the messages still
    read), the next column's markers, and the messages still read after it (a message whose marker or
    length does not fit is dropped, and reads as null here). None: a value is not UTF-8, or the
    column's texts overflow one array."""
    count = len(position)
    inside = bulk & (position < ends)
    kind = buffer[np.where(inside, position, 0)]
    is_text = kind == _TEXT
    bulk = inside & (is_text | (kind == _NULL)) & ~(is_text & (position + 5 > ends))
    text = bulk & is_text
    # A null's (or a dropped message's) length bytes are not read: the buffer's first bytes instead,
    # then zeroed.
    head = np.where(text, position + 1, 0)
    size = (
        (buffer[head].astype(np.int64) << 24)
        | (buffer[head + 1].astype(np.int64) << 16)
        | (buffer[head + 2].astype(np.int64) << 8)
        | buffer[head + 3].astype(np.int64)
    )
    first = position + 5
    fits = ~text | (first + size <= ends)
    bulk &= fits
    text &= fits
    size = np.where(text, size, 0)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    total = int(offsets[-1])
    if total > _MAX_OFFSET:
        return None
    # Every value's bytes, end to end: each value's start, shifted by where it lands in the column.
    take = np.repeat(first - offsets[:-1], size) + np.arange(total, dtype=np.int64)
    nulls = count - int(np.count_nonzero(text))
    validity = None if not nulls else pa.py_buffer(np.packbits(text, bitorder="little"))
    array = pa.Array.from_buffers(
        pa.string(),
        count,
        [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(buffer[take])],
        null_count=nulls,
    )
    try:
        array.validate(full=True)  # UTF-8, as str.decode would insist
    except pa.ArrowInvalid:
        return None
    return array, np.where(text, first + size, position + 1), bulk
