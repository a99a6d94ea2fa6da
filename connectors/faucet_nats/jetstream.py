"""A NATS connection and the few JetStream API requests the connector makes, as typed errors.

The API is spoken directly (JSON over request/reply on ``$JS.API.>``) rather than through nats-py's
JetStream manager, because the source needs fields that manager drops or rounds: the stream's
creation time to the nanosecond (part of the incarnation) and the configured first sequence.
"""

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from faucet_dagster.protocol import (
    AuthError,
    ConnectionFailed,
    CredentialsFileAuth,
    ErrorKind,
    FaucetError,
    TokenAuth,
    UserPasswordAuth,
)
from faucet_nats.config import NatsConnectionConfig

STREAM_NOT_FOUND = 10059
CONSUMER_NOT_FOUND = 10014
NO_MESSAGE_FOUND = 10037


class JetStreamRefused(FaucetError):
    """JetStream answered an API request with an error; ``err_code`` is the server's code."""

    kind = ErrorKind.CONFIG

    def __init__(self, message: str, *, err_code: int, where: str) -> None:
        super().__init__(message, where=where, details={"err_code": str(err_code)})
        self.err_code = err_code


@dataclass(frozen=True)
class StreamFacts:
    """What the source needs to know about a stream, read in one request.

    ``first_seq`` is the first stored sequence (``last_seq + 1`` when the stream is empty);
    ``incarnation`` identifies this stream's life: its creation time to the nanosecond and its
    configured first sequence, so a deleted and recreated stream of the same name differs.
    ``last_time`` is the server's RFC 3339 timestamp of the last message (empty when unknown).
    """

    name: str
    created: str
    configured_first_seq: int
    first_seq: int
    last_seq: int
    messages: int
    last_time: str = ""

    @property
    def incarnation(self) -> str:
        return f"{self.created}#{self.configured_first_seq}"


@dataclass(frozen=True)
class Removed:
    """What a stream no longer stores: every sequence before ``first_seq`` (purged, expired, limited
    away) and the interior ``deleted`` sequences (sorted), as STREAM.INFO reported them.

    A removed sequence held a message once, of a subject nobody can tell any more: it can never be
    proven to hold nothing a consumer should have delivered.
    """

    first_seq: int
    deleted: tuple[int, ...]

    def count_within(self, low: int, high: int) -> int:
        """How many of the sequences ``low`` to ``high`` (inclusive) were removed."""
        if high < low:
            return 0
        head = max(0, min(high, self.first_seq - 1) - low + 1)
        start = max(low, self.first_seq)
        interior = bisect.bisect_right(self.deleted, high) - bisect.bisect_left(self.deleted, start)
        return head + max(0, interior)


def describe_servers(config: NatsConnectionConfig) -> str:
    """The servers as people read them (never with credentials: the config refuses those)."""
    return ",".join(config.servers)


async def connect(config: NatsConnectionConfig, *, where: str) -> Client:
    """Connect to the configured servers; AuthError or ConnectionFailed name the servers, not secrets."""

    refused: list[bool] = []

    async def quiet(exc: Exception) -> None:
        # Asynchronous client errors (a dropped connection it then re-establishes) are seen by the
        # callers as request failures or delivery gaps; the default callback would only log them. One
        # kind is remembered: the server's "Authorization Violation", which nats-py reports here and
        # then, after its retries, hides behind NoServersError.
        if not refused and _is_authorization_violation(exc):
            refused.append(True)

    options: dict[str, Any] = {}
    auth = config.auth
    if isinstance(auth, UserPasswordAuth):
        options["user"] = auth.config.username
        options["password"] = auth.config.password.get_secret_value()
    elif isinstance(auth, TokenAuth):
        options["token"] = auth.config.token.get_secret_value()
    elif isinstance(auth, CredentialsFileAuth):
        options["user_credentials"] = auth.config.path
    try:
        client: Client = await nats.connect(
            list(config.servers),
            name=config.client_name,
            connect_timeout=max(1, round(config.connect_timeout)),
            max_reconnect_attempts=3,
            allow_reconnect=True,
            error_cb=quiet,
            pending_size=64 * 1024 * 1024,
            # A forced flush (64 MiB unsent) waits at most this long, not for ever (nats-py's default).
            flush_timeout=config.request_timeout,
            **options,
        )
    except nats.errors.AuthorizationError as exc:
        raise AuthError(f"NATS refused the credentials at {describe_servers(config)}", where=where) from exc
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        if refused:
            raise AuthError(
                f"NATS refused the credentials at {describe_servers(config)} (Authorization Violation): "
                "check auth",
                where=where,
            ) from exc
        raise ConnectionFailed(
            f"cannot connect to NATS at {describe_servers(config)}: {type(exc).__name__}", where=where
        ) from exc
    return client


def _is_authorization_violation(exc: Exception) -> bool:
    """True for the server refusing the credentials (nats-py raises it as a plain ``nats.errors.Error``
    carrying the server's ``-ERR 'Authorization Violation'`` while connecting)."""
    if isinstance(exc, nats.errors.AuthorizationError):
        return True
    text = str(exc).lower()
    return isinstance(exc, nats.errors.Error) and (
        "authorization violation" in text or "authentication expired" in text
    )


class JetStreamApi:
    """The JetStream API requests the connector makes, each returning parsed JSON or raising typed.

    Transport failures (timeout, no responders, a closed connection) raise :class:`ConnectionFailed`;
    an error answer raises :class:`JetStreamRefused` carrying the server's ``err_code``.
    """

    def __init__(self, client: Client, config: NatsConnectionConfig) -> None:
        self.client = client
        self._prefix = config.api_prefix
        self._timeout = config.request_timeout

    async def request(self, subject: str, body: Mapping[str, Any] | None, *, where: str) -> dict[str, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        try:
            reply = await self.client.request(f"{self._prefix}.{subject}", payload, timeout=self._timeout)
        except nats.errors.NoRespondersError as exc:
            raise ConnectionFailed(
                f"no JetStream answers {self._prefix} (is JetStream enabled for this account?)", where=where
            ) from exc
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            raise ConnectionFailed(
                f"JetStream request {subject} failed: {type(exc).__name__}", where=where
            ) from exc
        try:
            answer = json.loads(reply.data)
        except ValueError as exc:
            raise ConnectionFailed(f"JetStream sent a malformed answer to {subject}", where=where) from exc
        if not isinstance(answer, dict):
            raise ConnectionFailed(f"JetStream sent a malformed answer to {subject}", where=where)
        error = answer.get("error")
        if error:
            raise JetStreamRefused(
                f"JetStream refused {subject}: {error.get('description', error)}",
                err_code=int(error.get("err_code", 0)),
                where=where,
            )
        return answer

    async def stream(self, stream: str) -> StreamFacts:
        """The stream's facts; a missing stream raises JetStreamRefused with STREAM_NOT_FOUND."""
        where = f"nats stream {stream}"
        answer = await self.request(f"STREAM.INFO.{stream}", None, where=where)
        try:
            state = answer["state"]
            last_seq = int(state["last_seq"])
            messages = int(state["messages"])
            # An empty stream reports first_seq 0 before its first message and last_seq + 1 after a
            # purge; either way nothing at or below last_seq is stored.
            first_seq = int(state["first_seq"]) if messages else last_seq + 1
            return StreamFacts(
                name=stream,
                created=str(answer["created"]),
                configured_first_seq=int(answer["config"].get("first_seq") or 1),
                first_seq=first_seq,
                last_seq=last_seq,
                messages=messages,
                last_time=str(state.get("last_ts") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConnectionFailed("JetStream sent stream info without its state", where=where) from exc

    async def removed(self, stream: str) -> Removed:
        """What ``stream`` no longer stores, read now (with the interior deletions in detail)."""
        where = f"nats stream {stream}"
        answer = await self.request(f"STREAM.INFO.{stream}", {"deleted_details": True}, where=where)
        try:
            state = answer["state"]
            first_seq = int(state["first_seq"]) if int(state["messages"]) else int(state["last_seq"]) + 1
            deleted = tuple(sorted(int(seq) for seq in state.get("deleted") or ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConnectionFailed("JetStream sent stream info without its state", where=where) from exc
        return Removed(first_seq, deleted)

    async def create_consumer(self, stream: str, config: Mapping[str, Any], *, durable: str | None) -> None:
        subject = f"CONSUMER.CREATE.{stream}" + (f".{durable}" if durable else "")
        await self.request(subject, {"stream_name": stream, "config": config}, where=f"nats stream {stream}")

    async def delete_consumer(self, stream: str, name: str) -> bool:
        """Delete consumer ``name``; False when it did not exist."""
        try:
            await self.request(f"CONSUMER.DELETE.{stream}.{name}", None, where=f"nats stream {stream}")
        except JetStreamRefused as exc:
            if exc.err_code == CONSUMER_NOT_FOUND:
                return False
            raise
        return True

    async def consumer(self, stream: str, name: str) -> dict[str, Any] | None:
        """The consumer's info, or None when it does not exist."""
        try:
            return await self.request(f"CONSUMER.INFO.{stream}.{name}", None, where=f"nats stream {stream}")
        except JetStreamRefused as exc:
            if exc.err_code == CONSUMER_NOT_FOUND:
                return None
            raise

    async def next_sequence(self, stream: str, after: int, subject: str | None) -> int | None:
        """The sequence of the first stored message after ``after`` matching ``subject`` (any subject
        when None), read from the stream itself; None when there is none."""
        body = {"seq": after + 1, "next_by_subj": subject or ">"}
        try:
            answer = await self.request(f"STREAM.MSG.GET.{stream}", body, where=f"nats stream {stream}")
        except JetStreamRefused as exc:
            if exc.err_code == NO_MESSAGE_FOUND:
                return None
            raise
        try:
            return int(answer["message"]["seq"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConnectionFailed(
                "JetStream sent a message without its sequence", where=f"nats stream {stream}"
            ) from exc


def stream_missing(exc: FaucetError) -> bool:
    return isinstance(exc, JetStreamRefused) and exc.err_code == STREAM_NOT_FOUND


__all__ = [
    "JetStreamApi",
    "JetStreamRefused",
    "Removed",
    "StreamFacts",
    "connect",
    "describe_servers",
    "stream_missing",
]
