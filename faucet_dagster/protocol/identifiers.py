"""Identifier lengths: a name a database would silently shorten is refused before it is used.

PostgreSQL truncates identifiers longer than 63 bytes (NAMEDATALEN - 1) with only a NOTICE, so two
configured tables sharing a 63-byte prefix would be one table, and a 64-byte column would be written
under another name than the data carries. Other databases refuse or truncate at their own limits
(MySQL 64 characters, SQL Server and Oracle 128); SQLite has none.
"""

POSTGRES_MAX_IDENTIFIER_BYTES = 63
"""The longest identifier PostgreSQL keeps as written, in bytes of its UTF-8 encoding."""


def identifier_too_long(
    name: str, *, max_bytes: int | None = None, max_chars: int | None = None, database: str = "PostgreSQL"
) -> str | None:
    """Why ``name`` does not fit ``database``'s identifier limit (a message naming it and its length),
    or None when it fits. ``max_bytes`` counts UTF-8 bytes (PostgreSQL), ``max_chars`` characters."""
    if max_bytes is not None:
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            return (
                f"the name {name!r} is {size} bytes long; {database} would truncate it to "
                f"{max_bytes} bytes (use a shorter name)"
            )
    if max_chars is not None and len(name) > max_chars:
        return (
            f"the name {name!r} is {len(name)} characters long; {database} allows at most {max_chars} "
            "(use a shorter name)"
        )
    return None


def postgres_identifier_problem(name: str) -> str | None:
    """:func:`identifier_too_long` at PostgreSQL's limit (63 bytes)."""
    return identifier_too_long(name, max_bytes=POSTGRES_MAX_IDENTIFIER_BYTES)
