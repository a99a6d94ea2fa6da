"""A table's pgoutput change messages decoded in bulk, straight into Arrow text columns.

:func:`faucet_postgres.pgoutput.decode` builds, per message, a message tuple, its tuple data and a
Python string per value, which :class:`faucet_postgres.cdc_rows.Table` then turns column by column into
Arrow: in a change stream most of a read's time. Here the messages of one batch are laid end to end
in one buffer, and each column is cut out of it with array operations (NumPy) into an Arrow string
array: no Python object per value. The result is exactly the texts ``decode`` gives (a property test
compares them on generated messages). A batch this cannot decode as a whole (a malformed message, a
value that is not UTF-8, a column marker other than text or null) yields None: the caller then decodes
message by message, which raises the precise :class:`IntegrityError`.

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


def tuple_columns(messages: Sequence[bytes], width: int) -> list[pa.Array] | None:
    """The ``width`` columns of ``messages`` (change messages of one relation, each with one tuple of
    ``width`` columns at :data:`TUPLE_START`) as Arrow string arrays, a value's text or null; None
    when one of them cannot be decoded so (the caller decodes them one by one instead, to raise the
    precise error, or to name an update's unchanged columns: the 'u' marker is declined here)."""
    count = len(messages)
    buffer = np.frombuffer(b"".join(messages), dtype=np.uint8)
    lengths = np.fromiter(map(len, messages), dtype=np.int64, count=count)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if bool((lengths < TUPLE_START + 2).any()):
        return None
    declared = (buffer[starts + TUPLE_START].astype(np.int64) << 8) | buffer[starts + TUPLE_START + 1]
    if bool((declared != width).any()):
        return None
    position = starts + TUPLE_START + 2
    columns: list[pa.Array] = []
    for _ in range(width):
        column = _column(buffer, position, ends)
        if column is None:
            return None
        array, position = column
        columns.append(array)
    return columns


def _column(
    buffer: npt.NDArray[np.uint8], position: Positions, ends: Positions
) -> tuple[pa.Array, Positions] | None:
    """The column whose markers are at ``position`` (one per message), and the next column's."""
    count = len(position)
    if bool((position >= ends).any()):
        return None
    kind = buffer[position]
    text = kind == _TEXT
    if not bool((text | (kind == _NULL)).all()) or bool((text & (position + 5 > ends)).any()):
        return None
    # A null's length bytes are not there: read the message's first bytes instead, then zero them.
    head = np.where(text, position + 1, 0)
    size = (
        (buffer[head].astype(np.int64) << 24)
        | (buffer[head + 1].astype(np.int64) << 16)
        | (buffer[head + 2].astype(np.int64) << 8)
        | buffer[head + 3].astype(np.int64)
    )
    size = np.where(text, size, 0)
    first = position + 5
    if bool((text & (first + size > ends)).any()):
        return None
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
    return array, np.where(text, first + size, position + 1)
