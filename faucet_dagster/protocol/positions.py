"""Positions with a stable meaning: ordering domains, codecs, event identities and commit tokens.

A position is only meaningful inside its :class:`OrderingDomain`: the part of a source whose positions
compare (one Kafka partition, one JetStream stream, one PostgreSQL replication slot), together with
its incarnation (the Kafka topic id, the stream's creation time and first sequence, the server's
system identifier and slot). Positions are persisted as canonical strings; a :class:`PositionCodec`
validates, compares and canonicalizes them. Codecs are found by name in a registry filled from the
``faucet.position_codecs`` entry points, with no connector config and no network, so the state store
interprets a stored position exactly as the source that produced it.
"""

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import total_ordering
from importlib.metadata import entry_points
from threading import Lock
from typing import Any, ClassVar, Generic, TypeVar

from faucet_dagster.protocol.errors import ConfigError, DataError, IncarnationChanged, IntegrityError

P = TypeVar("P")

CODEC_ENTRY_POINT_GROUP = "faucet.position_codecs"


@dataclass(frozen=True)
class OrderingDomain:
    """The part of a source whose positions compare, plus the incarnation they belong to.

    ``codec`` names the :class:`PositionCodec` that interprets positions of this domain; it is part
    of the domain so a stored position can be read back without the connector that wrote it.
    Positions from two domains with the same ``(source, resource, partition)`` but different
    ``incarnation`` never compare: the source was recreated in between.
    """

    source: str
    resource: str
    partition: str
    incarnation: str
    codec: str

    @property
    def lineage(self) -> tuple[str, str, str]:
        """The domain without its incarnation: what stays the same when a source is recreated."""
        return (self.source, self.resource, self.partition)

    def key(self) -> str:
        """A stable, human-readable identifier of the domain, including its incarnation."""
        return "/".join((self.source, self.resource, self.partition, self.incarnation))

    def __str__(self) -> str:
        return self.key()


class PositionCodec(ABC, Generic[P]):
    """Validates, compares and canonicalizes the positions of one kind of source.

    Contract (checked by property tests for every registered codec):

    * ``validate(raw)`` returns a position or raises :class:`DataError` for anything malformed; it
      accepts the codec's own canonical strings, so ``validate(canonicalize(p)) == p``;
    * ``compare`` is a total order, and ``compare(a, b) == 0`` exactly when
      ``canonicalize(a) == canonicalize(b)``;
    * no method does I/O or needs connector config.
    """

    name: ClassVar[str]

    @abstractmethod
    def validate(self, raw: object) -> P:
        """Parse ``raw`` (a canonical string, or the source's native value) into a position."""

    @abstractmethod
    def compare(self, a: P, b: P) -> int:
        """Return a negative number, zero or a positive number as ``a`` is before, at or after ``b``."""

    @abstractmethod
    def canonicalize(self, position: P) -> str:
        """The one string form of ``position`` that is persisted in bookmarks and certificates."""


class IntegerPositionCodec(PositionCodec[int]):
    """A codec for positions that are non-negative integers (offsets, sequences).

    Subclasses set ``name``, ``minimum`` and ``maximum``. Canonical form: the decimal digits, no sign,
    no leading zeros. Accepts ints and canonical strings; rejects bools, floats, values outside
    ``minimum`` to ``maximum`` and anything else. ``maximum`` defaults to int64's (a Kafka offset's
    type, and what the engine and the sinks store a position as): a position past it would not
    compare or persist, so it is refused where it enters.
    """

    minimum: ClassVar[int] = 0
    maximum: ClassVar[int] = 2**63 - 1

    def validate(self, raw: object) -> int:
        if isinstance(raw, bool):
            raise DataError(f"a {self.name} position must be an integer, got a boolean", where=self.name)
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str) and raw.isascii() and raw.isdigit() and (raw == "0" or raw[0] != "0"):
            value = int(raw)
        else:
            raise DataError(f"a {self.name} position must be an integer, got {raw!r}", where=self.name)
        if value < self.minimum:
            raise DataError(f"a {self.name} position must be >= {self.minimum}, got {value}", where=self.name)
        if value > self.maximum:
            raise DataError(f"a {self.name} position must be <= {self.maximum}, got {value}", where=self.name)
        return value

    def compare(self, a: int, b: int) -> int:
        return (a > b) - (a < b)

    def canonicalize(self, position: int) -> str:
        return str(self.validate(position))


@dataclass(frozen=True)
@total_ordering
class Position:
    """A canonical position inside its ordering domain.

    Comparing two positions of different incarnations raises :class:`IncarnationChanged`; comparing
    positions of different domains raises :class:`IntegrityError`. Neither ever returns an answer.
    """

    domain: OrderingDomain
    value: str

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Position):
            return NotImplemented
        return compare_positions(self, other) < 0


def compare_positions(a: Position, b: Position, registry: "CodecRegistry | None" = None) -> int:
    """Compare two positions of the same domain and incarnation through the domain's codec."""
    if a.domain.lineage != b.domain.lineage or a.domain.codec != b.domain.codec:
        raise IntegrityError(f"positions of different domains do not compare: {a.domain} and {b.domain}")
    if a.domain.incarnation != b.domain.incarnation:
        raise IncarnationChanged(
            f"positions of different incarnations do not compare: {a.domain.incarnation!r} "
            f"and {b.domain.incarnation!r}",
            where="/".join(a.domain.lineage),
        )
    codec = (registry or default_codec_registry()).get(a.domain.codec)
    return codec.compare(codec.validate(a.value), codec.validate(b.value))


@dataclass(frozen=True)
class EventIdentity:
    """A stable identity for one event: the same on every replay, never built from a run or worker.

    ``ordinal`` tells apart events that share one position (the rows of one PostgreSQL transaction
    share its commit LSN; a Kafka offset has ordinal 0).
    """

    domain: OrderingDomain
    position: str
    ordinal: int = 0

    def __str__(self) -> str:
        return f"{self.domain.key()}@{self.position}#{self.ordinal}"

    def digest(self) -> str:
        """A short stable id (32 hex characters) for destinations that limit id length."""
        return hashlib.blake2b(str(self).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, order=True)
class CommitToken:
    """A monotonic commit token: fixed width, so its string form sorts like its number."""

    WIDTH: ClassVar[int] = 20
    sequence: int

    def __post_init__(self) -> None:
        if isinstance(self.sequence, bool) or not isinstance(self.sequence, int) or self.sequence < 0:
            raise DataError(f"a commit token is a non-negative integer, got {self.sequence!r}")
        if self.sequence >= 10**self.WIDTH:
            raise DataError(f"a commit token has at most {self.WIDTH} digits, got {self.sequence}")

    def __str__(self) -> str:
        return f"{self.sequence:0{self.WIDTH}d}"

    def next(self) -> "CommitToken":
        return CommitToken(self.sequence + 1)

    @classmethod
    def parse(cls, text: str) -> "CommitToken":
        """Read back a token written by ``str(token)``; anything else raises :class:`DataError`."""
        if len(text) != cls.WIDTH or not (text.isascii() and text.isdigit()):
            raise DataError(f"a commit token is {cls.WIDTH} digits, got {text!r}")
        return cls(int(text))


class CodecRegistry:
    """Position codecs by name.

    The default registry loads the ``faucet.position_codecs`` entry points on first use: each entry
    point names a :class:`PositionCodec` subclass whose constructor takes no arguments. Loading does
    no I/O beyond importing the codec's module and needs no connector config.
    """

    def __init__(self, codecs: Mapping[str, PositionCodec[Any]] | None = None) -> None:
        self._codecs: dict[str, PositionCodec[Any]] = dict(codecs or {})

    @classmethod
    def from_entry_points(cls) -> "CodecRegistry":
        registry = cls()
        for entry_point in entry_points(group=CODEC_ENTRY_POINT_GROUP):
            codec_type = entry_point.load()
            codec = codec_type()
            if not isinstance(codec, PositionCodec):
                raise ConfigError(
                    f"entry point {entry_point.name!r} does not name a PositionCodec",
                    where=CODEC_ENTRY_POINT_GROUP,
                )
            if codec.name != entry_point.name:
                raise ConfigError(
                    f"entry point {entry_point.name!r} names a codec called {codec.name!r}",
                    where=CODEC_ENTRY_POINT_GROUP,
                )
            registry.register(codec)
        return registry

    def register(self, codec: PositionCodec[Any]) -> None:
        existing = self._codecs.get(codec.name)
        if existing is not None and type(existing) is not type(codec):
            raise ConfigError(f"two codecs are registered as {codec.name!r}", where=CODEC_ENTRY_POINT_GROUP)
        self._codecs[codec.name] = codec

    def get(self, name: str) -> PositionCodec[Any]:
        try:
            return self._codecs[name]
        except KeyError:
            raise ConfigError(
                f"no position codec is registered as {name!r} (known: {', '.join(sorted(self._codecs))})",
                where=CODEC_ENTRY_POINT_GROUP,
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._codecs))

    def __iter__(self) -> Iterator[PositionCodec[Any]]:
        return iter(self._codecs[name] for name in self.names())


_default_registry: CodecRegistry | None = None
_default_registry_lock = Lock()


def default_codec_registry() -> CodecRegistry:
    """The process-wide registry filled from the installed entry points (loaded once)."""
    global _default_registry
    with _default_registry_lock:
        if _default_registry is None:
            _default_registry = CodecRegistry.from_entry_points()
        return _default_registry
