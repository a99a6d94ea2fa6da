"""What an epoch's pipeline saw of one ordering domain: its certified start, its last row, its last
accepted boundary and open transaction, and the position checks rows and boundaries must pass.
"""

from typing import Any

from faucet_dagster.pipeline.builder import Builder
from faucet_dagster.protocol import FaucetError, IntegrityError, OrderingDomain, PositionCodec


class DomainState:
    """What the pipeline saw of one ordering domain in this epoch."""

    __slots__ = (
        "boundary",
        "builders",
        "codec",
        "domain",
        "floor",
        "last_row",
        "open_transaction",
        "start",
        "start_text",
        "unbounded_rows",
    )

    def __init__(self, domain: OrderingDomain, codec: PositionCodec[Any], start: str | None) -> None:
        self.domain = domain
        self.codec = codec
        self.start_text = start
        self.start: Any = None if start is None else self.decode(start)
        self.last_row: Any = None
        self.floor: Any = None
        self.boundary: Any = None
        self.open_transaction: str | None = None
        self.unbounded_rows = False
        self.builders: list[Builder] = []

    def decode(self, raw: object) -> Any:
        try:
            return self.codec.validate(raw)
        except FaucetError as exc:
            raise IntegrityError(
                f"position {raw!r} is not valid: {exc.message}", where=str(self.domain)
            ) from exc

    def accept_rows(self, first: str, last: str) -> None:
        """Check one write's positions. Writes go forward, except inside a transaction: there rows of
        several resources may come in any order (a transaction is applied whole), never before what
        preceded the transaction."""
        low, high = self.decode(first), self.decode(last)
        compare = self.codec.compare
        floor = self.last_row if self.open_transaction is None else self.floor
        if floor is not None and compare(low, floor) < 0:
            raise IntegrityError(f"rows went back from {floor} to {first}", where=str(self.domain))
        if self.start is not None and compare(low, self.start) <= 0:
            raise IntegrityError(
                f"row at {first} is at or before the certified position {self.start_text}",
                where=str(self.domain),
            )
        if self.boundary is not None and compare(low, self.boundary) <= 0:
            # A boundary vouches that everything up to it was read: a row at or behind it is either
            # a duplicate or one the source skipped before vouching (an ordering bug of the source).
            boundary = self.codec.canonicalize(self.boundary)
            raise IntegrityError(
                f"row at {first} is at or before the accepted boundary {boundary}", where=str(self.domain)
            )
        if compare(high, low) < 0:
            raise IntegrityError(f"rows went back from {first} to {last}", where=str(self.domain))
        if self.last_row is None or compare(high, self.last_row) > 0:
            self.last_row = high
        self.unbounded_rows = True

    def check_boundary(self, position: str) -> Any:
        """Decode a boundary position and check it is not before anything already seen."""
        value = self.decode(position)
        compare = self.codec.compare
        for label, floor in (
            ("last row", self.last_row),
            ("previous boundary", self.boundary),
            ("certified position", self.start),
        ):
            if floor is not None and compare(value, floor) < 0:
                raise IntegrityError(
                    f"boundary {position} is before the {label} {self.codec.canonicalize(floor)}",
                    where=str(self.domain),
                )
        return value
