"""Position codec of PostgreSQL logical replication: a log sequence number (LSN)."""

import re

from faucet_dagster.protocol import DataError, PositionCodec

_LSN = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_MAX_LSN = 2**64 - 1


class PostgresLsnCodec(PositionCodec[int]):
    """An LSN as PostgreSQL prints it (``16/B374D848``) or as its 64-bit integer value.

    Canonical form: upper-case hex halves without leading zeros, exactly as ``pg_lsn`` prints it, so
    a canonical position can be passed back to PostgreSQL as a ``pg_lsn`` literal.
    """

    name = "postgres.lsn"

    def validate(self, raw: object) -> int:
        if isinstance(raw, bool):
            raise DataError("an LSN must be 'X/Y' or an integer, got a boolean", where=self.name)
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str) and (match := _LSN.fullmatch(raw)):
            value = (int(match.group(1), 16) << 32) | int(match.group(2), 16)
        else:
            raise DataError(f"an LSN must be 'X/Y' or an integer, got {raw!r}", where=self.name)
        if not 0 <= value <= _MAX_LSN:
            raise DataError(f"an LSN is a 64-bit unsigned value, got {value}", where=self.name)
        return value

    def compare(self, a: int, b: int) -> int:
        return (a > b) - (a < b)

    def canonicalize(self, position: int) -> str:
        value = self.validate(position)
        return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
