"""Position codec of PostgreSQL logical replication: a log sequence number (LSN)."""

import re

from faucet_dagster.protocol import DataError, PositionCodec

_LSN = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_MAX_LSN = 2**64 - 1

_KNOWN_LIMIT = 65_536
_known: dict[str, int] = {}
"""Canonical texts made by :meth:`PostgresLsnCodec.canonicalize` and their values, most recent ones
(cleared when it holds :data:`_KNOWN_LIMIT`): a change stream turns every commit LSN into text for
its rows' identities, and the sink turns the same texts back into numbers to order and fence them,
so validating one is a lookup, not a parse. Only exact canonical texts are kept (a text always means
the same LSN), so a lookup returns what parsing would."""


class PostgresLsnCodec(PositionCodec[int]):
    """An LSN as PostgreSQL prints it (``16/B374D848``) or as its 64-bit integer value.

    Canonical form: upper-case hex halves without leading zeros, exactly as ``pg_lsn`` prints it, so
    a canonical position can be passed back to PostgreSQL as a ``pg_lsn`` literal.
    """

    name = "postgres.lsn"

    def validate(self, raw: object) -> int:
        if isinstance(raw, str):
            known = _known.get(raw)
            if known is not None:
                return known
            match = _LSN.fullmatch(raw)
            if match is None:
                raise DataError(f"an LSN must be 'X/Y' or an integer, got {raw!r}", where=self.name)
            return (int(match.group(1), 16) << 32) | int(match.group(2), 16)
        if isinstance(raw, bool):
            raise DataError("an LSN must be 'X/Y' or an integer, got a boolean", where=self.name)
        if not isinstance(raw, int):
            raise DataError(f"an LSN must be 'X/Y' or an integer, got {raw!r}", where=self.name)
        if not 0 <= raw <= _MAX_LSN:
            raise DataError(f"an LSN is a 64-bit unsigned value, got {raw}", where=self.name)
        return raw

    def compare(self, a: int, b: int) -> int:
        return (a > b) - (a < b)

    def canonicalize(self, position: int) -> str:
        # Called once per source transaction: an LSN the decoder made skips the checks.
        value = position if type(position) is int and 0 <= position <= _MAX_LSN else self.validate(position)
        text = "%X/%X" % (value >> 32, value & 0xFFFFFFFF)  # noqa: UP031 (twice as fast as an f-string here)
        if len(_known) >= _KNOWN_LIMIT:
            _known.clear()
        _known[text] = value
        return text
