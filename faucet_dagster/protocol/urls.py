"""Credentials in URLs: found at config time and refused, so no URL a message, a dataset URI or Dagster
metadata prints ever holds a secret.

A URL is printed in many places (errors' ``where``, materialization metadata, logs), so redacting it in
each is fragile; refusing a credential-bearing URL up front, with a pointer to the ``auth`` field whose
secrets are ``SecretStr``, closes them all at once. Credential-bearing parts are the userinfo's password
(``scheme://user:SECRET@host``) and any query parameter whose name says it carries a secret
(``?password=``, ``?sslpassword=`` (libpq's client key passphrase), ``?token=``, ``?api_key=``...).
"""

from urllib.parse import parse_qsl, urlsplit

_SECRET_WORDS = (
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "secret",
    "token",
    "credential",
    "apikey",
    "api_key",
    "private_key",
)
"""Parts of a query parameter's name that mark its value as a secret (compared lowercased)."""


def url_credentials(url: str) -> list[str]:
    """The credential-bearing parts of ``url``, as names safe to print: ``"password"`` for a userinfo
    password, ``"query parameter NAME"`` for each secret-carrying query parameter. Empty when none.

    Never returns a value. A string that is not a URL (no ``//`` authority, no query) has none.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return ["password"] if "@" in url else []
    found: list[str] = []
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        found.append("password")
    for name, _value in parse_qsl(parts.query, keep_blank_values=True):
        lowered = name.lower()
        if any(word in lowered for word in _SECRET_WORDS):
            found.append(f"query parameter {name}")
    return found


def refuse_url_credentials(url: str, *, auth_hint: str = "auth") -> str:
    """``url`` unchanged, or ValueError naming (never showing) the credentials it carries and pointing
    to ``auth_hint`` (the config field credentials belong in). For pydantic field validators."""
    found = url_credentials(url)
    if found:
        raise ValueError(
            f"the URL carries credentials ({', '.join(found)}); remove them and put credentials in "
            f"{auth_hint}, whose secrets never reach logs, errors or metadata"
        )
    return url
