"""What a push consumer holds of its deliveries: the delivery tuple, chunks of them, and the bulk parse
of their acknowledgement subjects.

A delivery is held as a plain tuple ``(subject, reply, data, headers)`` (index with :data:`SUBJECT`,
:data:`REPLY`, :data:`DATA`, :data:`HEADERS`), not as a nats-py ``Msg``: a session holds every
delivered message until its acknowledgement (up to ``max_ack_pending``, 100,000 by default), and the
garbage collector stops tracking a tuple of strings and bytes at its first collection, where every
held ``Msg`` would be traversed by each older-generation collection (a tenth of the run in issue 15's
profile).
"""

from dataclasses import dataclass, field
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol import IntegrityError

Delivery = tuple[str, str, bytes, dict[str, str] | None]
"""One delivered message: subject, reply (its acknowledgement subject), payload, headers (or None)."""
SUBJECT: Final = 0
REPLY: Final = 1
DATA: Final = 2
HEADERS: Final = 3


@dataclass(eq=False)
class Chunk:
    """Consecutive new messages of one consumer, in stream order, with what was parsed from them.

    Compared by identity: a chunk is tracked as one object moving between ready, reading and covered.

    ``seqs`` are their stream sequences (strictly increasing), ``positions`` the same as canonical
    strings, ``stamps`` the server timestamps in nanoseconds (when parsed). ``gaps`` lists the
    ``(after, before)`` pairs of stream sequences whose absence is not proven yet. ``touched`` is
    when the server last heard about these messages (delivery or ``+WPI``), on the monotonic clock.
    """

    msgs: list[Delivery]
    seqs: pa.Int64Array
    positions: list[str]
    stamps: pa.Int64Array | None
    touched: float
    gaps: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.msgs)

    @property
    def first(self) -> int:
        return int(self.seqs[0].as_py())

    @property
    def last(self) -> int:
        return int(self.seqs[-1].as_py())

    def split(self, count: int) -> tuple["Chunk", "Chunk"]:
        """The first ``count`` messages and the rest (each keeps the gaps that precede its messages)."""
        cut = self.first - 1 if count == 0 else int(self.seqs[count - 1].as_py())
        head = Chunk(
            self.msgs[:count],
            self.seqs.slice(0, count),
            self.positions[:count],
            None if self.stamps is None else self.stamps.slice(0, count),
            self.touched,
            [gap for gap in self.gaps if gap[1] <= cut],
        )
        tail = Chunk(
            self.msgs[count:],
            self.seqs.slice(count),
            self.positions[count:],
            None if self.stamps is None else self.stamps.slice(count),
            self.touched,
            [gap for gap in self.gaps if gap[1] > cut],
        )
        return head, tail


@dataclass(frozen=True)
class Parsed:
    """The fields of a run of acknowledgement subjects, column-wise."""

    seqs: pa.Int64Array
    deliveries: pa.Int64Array
    positions: list[str]
    stamps: pa.Int64Array | None


def strictly_increasing(values: pa.Int64Array) -> bool:
    if len(values) < 2:
        return True
    return bool(pc.all(pc.greater(values.slice(1), values.slice(0, len(values) - 1))).as_py())


def reply_prefix(reply: str, stream: str, where: str) -> str:
    """The part of ``reply`` (an acknowledgement subject) naming the stream and consumer, with its dot.

    Raises :class:`IntegrityError` when it is not an acknowledgement subject of ``stream``.
    """
    tokens = reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<tail> or $JS.ACK.<domain>.<account>.<stream>.<consumer>.<tail>
    head = 4 if len(tokens) == 9 else 6
    if len(tokens) not in (9, 11, 12) or tokens[head - 2] != stream:
        raise IntegrityError(f"an unexpected acknowledgement subject {reply!r}", where=where)
    return ".".join(tokens[:head]) + "."


def parse_replies(replies: list[str], prefix: str, *, with_stamps: bool, where: str) -> Parsed:
    """Stream sequence, delivery number (and timestamp) of each acknowledgement subject, in bulk.

    Raises :class:`IntegrityError` when one does not start with ``prefix`` or is malformed. Pure:
    safe on a worker thread.
    """
    texts = pa.array(replies, pa.string())
    if not pc.all(pc.starts_with(texts, prefix)).as_py():
        raise IntegrityError(f"a message arrived from another consumer than {prefix}", where=where)
    tails = pc.binary_slice(texts.cast(pa.binary()), len(prefix), 1 << 16)
    # <delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>[.<token>]
    fields = pc.split_pattern(tails, b".", max_splits=4 if with_stamps else 3)
    seq_text = pc.list_element(fields, 1).cast(pa.string())
    try:
        seqs = seq_text.cast(pa.int64())
        deliveries = pc.list_element(fields, 2).cast(pa.string()).cast(pa.int64())
        stamps = pc.list_element(fields, 3).cast(pa.string()).cast(pa.int64()) if with_stamps else None
    except (pa.ArrowInvalid, IndexError) as exc:
        raise IntegrityError(f"malformed acknowledgement subjects: {exc}", where=where) from exc
    return Parsed(seqs, deliveries, seq_text.to_pylist(), stamps)
