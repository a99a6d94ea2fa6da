"""FCP check 6, no panic: bad config, an unreachable endpoint, a malformed record and an empty dataset
end in a FaucetError (an empty result for the empty dataset) within the timeout, for each role and
for every call the connector declares.
"""

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from faucet_dagster.conformance.bounded.common import PANIC_RULE, read_all
from faucet_dagster.conformance.harness import (
    QUIET,
    STREAM,
    WORKER,
    StreamDriver,
    Subject,
    covering,
    open_sink_session,
    quietly_close,
    rows_batch,
    sink_batch,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.protocol import Coverage, EpochId, FaucetError, Role, Sink, Source


async def no_panic(subject: Subject) -> Outcome:
    """Bad config, an unreachable endpoint, a malformed record: a FaucetError in time; empty: empty."""
    setup = subject.setup
    exercise = _EXERCISES[subject.role]
    done: list[str] = []
    for label, config in _bad_configs(subject):
        await _expect_error(subject, f"bad config ({label})", functools.partial(exercise, subject, config))
    done.append("bad config")
    if setup.unreachable is not None:
        unreachable = setup.unreachable
        await _expect_error(
            subject, "an unreachable endpoint", functools.partial(exercise, subject, unreachable)
        )
        done.append("unreachable endpoint")
    done.extend(await _declared_calls(subject))
    try:
        count = await exercise(subject, None)
    except FaucetError as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"an empty dataset raised {type(exc).__name__}: {exc}; an empty result is no error"
        ) from exc
    if count:
        raise ConformanceFailure(PANIC_RULE, f"an empty dataset gave {count} rows")
    done.append("empty result")
    malformed = await _malformed(subject)
    if malformed is not None:
        await _expect_error(subject, "a malformed record", malformed)
        done.append("malformed record")
    return Outcome.passed(", ".join(done) + " handled", exercised=tuple(done))


async def _declared_calls(subject: Subject) -> list[str]:
    """``check()`` and every other call the connector declares (``discover``, ``enumerate_shards``,
    ``apply_shard``, ``capture_resume_position``): each works on the setup's config and ends in a
    FaucetError, in time, on the unreachable one (never a raw client exception)."""
    if subject.role not in (Role.SOURCE, Role.SINK):
        return []
    setup = subject.setup
    built = subject.build()
    assert isinstance(built, Source | Sink)
    calls: list[tuple[str, Callable[[Source | Sink], Awaitable[object]]]] = [("check()", _preflight)]
    if isinstance(built, Source):
        caps = built.capabilities()
        if caps.discover:
            calls.append(("discover()", _discover))
        if caps.shardable:
            calls.append(("enumerate_shards()", _enumerate_shards))
        if type(built).capture_resume_position is not Source.capture_resume_position:
            calls.append(("capture_resume_position()", _capture))
    await _close(subject, built)
    done: list[str] = []
    for what, call in calls:
        connector = subject.build()
        assert isinstance(connector, Source | Sink)
        try:
            await _succeeds_or_fails(subject, f"{what} on a usable config", call, connector)
        finally:
            await _close(subject, connector)
        if setup.unreachable is not None:
            unreachable = functools.partial(_on_config, subject, call, dict(setup.unreachable))
            await _expect_error(subject, f"{what} on an unreachable endpoint", unreachable)
        done.append(what)
    if isinstance(built, Source) and built.capabilities().shardable:

        async def unknown_shard() -> object:
            source = subject.source()
            source.apply_shard("faucet-conformance-no-such-shard")
            return await read_all(subject, source, subject.options.batch_size, PANIC_RULE)

        try:
            await asyncio.wait_for(unknown_shard(), subject.options.timeout)
        except FaucetError:
            pass
        except TimeoutError:
            raise ConformanceFailure(PANIC_RULE, "a read of an unknown shard did not end (a hang)") from None
        except Exception as exc:
            raise ConformanceFailure(
                PANIC_RULE, f"apply_shard() of an unknown shard raised {type(exc).__name__}: {exc}"
            ) from exc
        done.append("apply_shard()")
    return done


async def _on_config(
    subject: Subject, call: Callable[[Source | Sink], Awaitable[object]], config: dict[str, Any]
) -> object:
    connector = subject.build(config)
    assert isinstance(connector, Source | Sink)
    try:
        return await call(connector)
    finally:
        await _close(subject, connector)


async def _preflight(connector: Source | Sink) -> object:
    await connector.check()
    return None


async def _discover(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.discover()


async def _enumerate_shards(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.enumerate_shards()


async def _capture(connector: Source | Sink) -> object:
    assert isinstance(connector, Source)
    return await connector.capture_resume_position()


async def _close(subject: Subject, connector: Source | Sink) -> None:
    await subject.within(connector.close(), PANIC_RULE, f"{type(connector).__name__}.close")


async def _succeeds_or_fails(
    subject: Subject,
    what: str,
    call: Callable[[Source | Sink], Awaitable[object]],
    connector: Source | Sink,
) -> None:
    try:
        await subject.within(call(connector), PANIC_RULE, what)
    except ConformanceFailure:
        raise
    except FaucetError as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc}; it must work where the reads work"
        ) from exc
    except Exception as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc} instead of a FaucetError"
        ) from exc


def _bad_configs(subject: Subject) -> list[tuple[str, dict[str, Any]]]:
    config = dict(subject.setup.config)
    variants = [("unknown key", {**config, "faucet_conformance_unknown": 1})]
    schema = subject.spec.roles[subject.role].config_model.json_schema()
    required = [name for name in schema.get("required", []) if name in config]
    if required:
        name = required[0]
        variants.append((f"{name} missing", {k: v for k, v in config.items() if k != name}))
        variants.append((f"{name} of a wrong type", {**config, name: {"not": ["a", "valid", "value"]}}))
    return variants


async def _expect_error(subject: Subject, what: str, step: Callable[[], Awaitable[object]]) -> None:
    try:
        await asyncio.wait_for(step(), subject.options.timeout)
    except FaucetError:
        return
    except ConformanceFailure:
        raise
    except TimeoutError:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} did not end within {subject.options.timeout:g}s (a hang)"
        ) from None
    except Exception as exc:
        raise ConformanceFailure(
            PANIC_RULE, f"{what} raised {type(exc).__name__}: {exc} instead of a FaucetError"
        ) from exc
    raise ConformanceFailure(PANIC_RULE, f"{what} ended without an error: a failure was swallowed")


async def _malformed(subject: Subject) -> Callable[[], Awaitable[object]] | None:
    """The step that must fail on a malformed record, or None when the setup has no such record."""
    setup = subject.setup
    if subject.role in (Role.SOURCE, Role.STREAM_SOURCE):
        add = getattr(setup, "add_malformed", None)
        if add is None:
            return None
        await add()
        if subject.role is Role.STREAM_SOURCE:
            # A row after the malformed record: the read must fail before certifying it. Waiting for
            # it, not for a quiet spell, tells "not read yet" from "swallowed" on a loaded machine.
            after = make_rows(_AFTER_MALFORMED, 1)
            await subject.source_setup.add_rows(after)
            return lambda: _stream_past_malformed(subject)
        return lambda: _EXERCISES[subject.role](subject, None)
    refused = getattr(setup, "refused_rows", None)
    if refused is None:
        return None
    return lambda: _EXERCISES[subject.role](subject, None, refused)


_AFTER_MALFORMED = 900_000
"""The id of the row added after the malformed record (even: the same Kafka partition as key 0)."""


async def _stream_past_malformed(subject: Subject) -> int:
    driver = StreamDriver(subject, PANIC_RULE)
    try:
        return len(await driver.read_until({_AFTER_MALFORMED}, QUIET))
    finally:
        await driver.close()


async def _exercise_source(subject: Subject, config: Any, rows: Any = None) -> int:
    source = subject.source(config)
    return sum(
        page.num_rows for page in await read_all(subject, source, subject.options.batch_size, PANIC_RULE)
    )


async def _exercise_sink(subject: Subject, config: Any, rows: Any = None) -> int:
    sink = subject.sink(config)
    try:
        written = await sink.write_batch(rows_batch(rows or []))
        await sink.flush()
        await sink.finish()
        return written
    finally:
        await sink.close()


async def _exercise_stream_source(subject: Subject, config: Any, rows: Any = None) -> int:
    driver = StreamDriver(subject, PANIC_RULE)
    try:
        await driver.open(subject.stream_source(config))
        _, ids = await driver.epoch(QUIET)
        return len(ids)
    finally:
        await driver.close()


async def _exercise_streaming_sink(subject: Subject, config: Any, rows: Any = None) -> int:
    session = await open_sink_session(subject, PANIC_RULE, config=config)
    try:
        epoch = EpochId(STREAM, 1, WORKER.fencing_token)
        await session.begin_epoch(epoch)
        coverage = covering(rows) if rows else Coverage()
        if rows:
            await session.apply(epoch, sink_batch(epoch, rows))
        receipts = await session.commit_epoch(epoch, coverage)
        await session.close_session()
        return sum(receipt.rows_written for receipt in receipts)
    except BaseException:
        await quietly_close(session)
        raise


_EXERCISES: dict[Role, Callable[..., Awaitable[int]]] = {
    Role.SOURCE: _exercise_source,
    Role.SINK: _exercise_sink,
    Role.STREAM_SOURCE: _exercise_stream_source,
    Role.STREAMING_SINK: _exercise_streaming_sink,
}
