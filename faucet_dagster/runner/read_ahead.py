"""Pages read one ahead of the writer: the bounded runner's only concurrency."""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

from faucet_dagster.protocol import Page


@asynccontextmanager
async def reading_ahead(pages: AsyncIterator[Page]) -> AsyncGenerator[AsyncIterator[Page], None]:
    """``pages``, read one page ahead from the moment this is entered (one page of read-ahead).

    The source reads page ``n + 1`` while the caller writes page ``n`` (page 1 while the caller gets
    ready). When the caller leaves early (an error, or it stops iterating), the read in flight is let
    finish (it is one page; cancelling it could leave a source's client mid-request) and dropped, with
    any error it raised, in favour of the caller's; then the source's generator is closed.
    """
    iterator = aiter(pages)
    pending: asyncio.Future[Page] = asyncio.ensure_future(anext(iterator))

    async def ahead() -> AsyncGenerator[Page, None]:
        nonlocal pending
        while True:
            try:
                page = await pending
            except StopAsyncIteration:
                return
            pending = asyncio.ensure_future(anext(iterator))
            yield page

    stream = ahead()
    try:
        yield stream
    finally:
        await stream.aclose()
        await asyncio.wait([pending])
        if not pending.cancelled():
            pending.exception()  # retrieved: the caller's own error (or normal end) takes precedence
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["reading_ahead"]
