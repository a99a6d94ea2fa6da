"""Deliveries of one subscription handed straight from the nats-py protocol parser to a function.

nats-py passes every message of a subscription with a callback through an ``asyncio.Queue`` to a
task that awaits the callback: per message a queue put and get, a task wake-up, a header coroutine
and a callback coroutine. For a JetStream push consumer that is a third of the event loop's time
(issue 15's profile). :func:`deliver_directly` routes the data messages of one subscription (those
whose reply is an acknowledgement subject) from the parser to a plain function instead, in the order
they arrived; everything else (flow control, idle heartbeats, consumer statuses, other
subscriptions, requests) takes nats-py's usual path.

Order: every data message of the subscription takes the direct route, so data messages keep their
order among themselves. A status message is handled by the subscription callback a little later than
it arrived, so data that arrived after it may have been delivered first: whoever handles statuses
must only compare them with what was received by then (never less than at their arrival).

This relies on nats-py internals (``Client._process_msg``, ``Client._process_headers``,
``Subscription._id``): when they are not as expected, nothing is rerouted and the callback receives
every message, as before.
"""

import inspect
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription

from faucet_nats.chunks import Delivery

_ACK_PREFIX = b"$JS.ACK."
_PARAMETERS = ["sid", "subject", "reply", "data", "headers"]


def _internals(client: Client, subscription: Subscription) -> tuple[Any, Any, int] | None:
    process = getattr(client, "_process_msg", None)
    process_headers = getattr(client, "_process_headers", None)
    sid = getattr(subscription, "_id", None)
    if (
        inspect.iscoroutinefunction(process)
        and inspect.iscoroutinefunction(process_headers)
        and isinstance(sid, int)
        and list(inspect.signature(process).parameters) == _PARAMETERS
    ):
        return process, process_headers, sid
    return None


def deliver_directly(
    client: Client, subscription: Subscription, deliver: Callable[[Delivery], None]
) -> Callable[[], None] | None:
    """Hand ``subscription``'s data messages to ``deliver`` as the parser reads them (see module doc).

    Call it right after subscribing, before anything is delivered to the subscription. Returns the
    function that restores the usual path; None when this nats-py's internals differ (nothing changed).
    """
    internals = _internals(client, subscription)
    if internals is None:
        return None
    process, process_headers, own = internals

    async def direct(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        if sid != own or not reply.startswith(_ACK_PREFIX):
            await process(sid, subject, reply, data, headers)
            return
        deliver((subject.decode(), reply.decode(), data, await process_headers(headers) if headers else None))

    client._process_msg = direct  # type: ignore[method-assign]

    def restore() -> None:
        if vars(client).get("_process_msg") is direct:
            del client._process_msg

    return restore
