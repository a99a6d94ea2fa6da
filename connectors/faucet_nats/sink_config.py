"""Configuration of the NATS sink (no client import: capabilities are read offline)."""

import re

from pydantic import Field

from faucet_nats.config import NatsConnectionConfig

_BUCKET = re.compile(r"[-\w]+")


class NatsSinkConfig(NatsConnectionConfig):
    """Where the sink publishes and what it expects of the target stream.

    ``stream`` must exist and capture ``subject``; the sink never creates or changes it.
    ``duplicate_window`` (seconds) is the stream's configured duplicate window: the capabilities
    declare it, and opening refuses a stream whose window differs. ``max_outstanding_acks`` bounds
    the publishes awaiting their acknowledgement (more keeps the connection full); ``ack_timeout``
    is how long a commit or a close waits for them in total, re-publishes included.
    ``republish_after``: a message still unacknowledged this long while the connection is up (its
    publish or acknowledgement was lost in a server restart or a dropped connection) is published
    again under the same ``Nats-Msg-Id``, at most ``republish_attempts`` times, only while within
    90% of ``duplicate_window`` since its first publish (so the stream stores it at most once; 0
    attempts never re-publishes). ``watermark_bucket`` is the key-value bucket (created when missing)
    holding each stream's last committed epoch and watermark.
    """

    stream: str = Field(min_length=1)
    subject: str = Field(min_length=1)
    duplicate_window: float = Field(default=120.0, gt=0)
    max_outstanding_acks: int = Field(default=20_000, ge=1)
    ack_timeout: float = Field(default=30.0, gt=0)
    republish_after: float = Field(default=5.0, gt=0)
    republish_attempts: int = Field(default=3, ge=0)
    watermark_bucket: str = Field(default="faucet_sink_watermarks", pattern=_BUCKET.pattern)
