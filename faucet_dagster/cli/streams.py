"""``faucet streams status`` and ``faucet streams release STREAM``: the state store from a terminal.

``status`` prints each stream's lease (owner, fencing token, time left, a pending hand-over request to
a newer worker), whether it is marked uncertain and why, its last certified epoch, how far Dagster
received reports, its certified positions and its dead-letter count; for a partition group of a
stream on several workers (``<stream>[g/groups]``), the group and the stream's live members.
``release`` is the operator's answer to an uncertain close: it clears the uncertain flag and the
lease so the stream can be taken over (the fencing token is kept, so the next owner still fences
every earlier one). A stream not marked uncertain whose lease is live is refused without ``--force``.
Both take ``--state-url`` (default: ``$FAUCET_STATE_URL``, else the SQLite file under
``$DAGSTER_HOME``) and ``--json``.
"""

import argparse
import json
import sys
from typing import Any

from faucet_dagster.cli.terminal import fit_line, fit_text, terminal_width
from faucet_dagster.protocol import EpochCertificate
from faucet_dagster.state.members import MemberRegistry, parse_group_stream
from faucet_dagster.state.status import StreamStatus
from faucet_dagster.state.store import StateStore


def add_streams_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``streams status`` and ``streams release`` to the ``faucet`` command line."""
    streams = commands.add_parser(
        "streams",
        help="inspect continuous streams and release them",
        description="The state store of continuous streams, from a terminal: each stream's lease, "
        "certified epochs, positions and lag, and the release of a stream marked uncertain.",
    )
    actions = streams.add_subparsers(dest="streams_command", required=True)
    status = actions.add_parser(
        "status",
        help="leases, uncertain flags, certified epochs and positions",
        description="Print each stream's lease (owner, fencing token, time left, a pending hand-over), "
        "whether it is marked uncertain and why, its last certified epoch and how far Dagster received "
        "its reports, its certified positions, its dead letters and its lag at the last certificate.",
    )
    status.add_argument("stream", nargs="?", help="one stream (default: every stream)")
    release = actions.add_parser(
        "release",
        help="clear a stream's uncertain flag and lease so it can be taken over",
        description="Clear a stream's uncertain flag and its lease so that a worker can take it over, "
        "once you checked that the destination holds all or none of the last epoch's effects. The "
        "fencing token is kept: the next owner still fences every earlier one.",
    )
    release.add_argument("stream", help="the stream to release")
    release.add_argument(
        "--force",
        action="store_true",
        help="release a stream that is not marked uncertain although a worker holds a live lease on it",
    )
    for parser in (status, release):
        parser.add_argument(
            "--state-url",
            help="SQLAlchemy URL of the state store (default: $FAUCET_STATE_URL, else "
            "$DAGSTER_HOME/faucet_state.db)",
        )
        parser.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=_status_command)
    release.set_defaults(handler=_release_command)


def _status_command(args: argparse.Namespace) -> int:
    """Print each stream's status, then its lag: how far the source's head was ahead of the last
    certificate when that epoch's read ended."""
    with StateStore(args.state_url) as store:
        statuses = store.status(args.stream)
        lasts = {status.stream: store.last_certificate(status.stream) for status in statuses}
        members = _members(store, statuses)
    if args.json:
        print(
            json.dumps(
                [
                    status.to_dict() | _lag_dict(lasts[status.stream]) | members.get(status.stream, {})
                    for status in statuses
                ],
                indent=2,
            )
        )
    elif not statuses:
        print(f"no streams in {store.where}")
    width = terminal_width()
    for status in [] if args.json else statuses:
        lines = [
            *_describe(status).splitlines(),
            *_member_lines(members.get(status.stream)),
            *_lag_lines(lasts[status.stream]),
        ]
        print(fit_text("\n".join(lines), width))
    return 0


def _members(store: StateStore, statuses: list[StreamStatus]) -> dict[str, dict[str, Any]]:
    """For each partition group's stream: its group, and the live members of the stream it divides."""
    registry = MemberRegistry(store)
    live: dict[str, list[str]] = {}
    found: dict[str, dict[str, Any]] = {}
    for status in statuses:
        parsed = parse_group_stream(status.stream)
        if parsed is None:
            continue
        stream, group, groups = parsed
        if stream not in live:
            live[stream] = [member.member for member in registry.live(stream)]
        found[status.stream] = {"group_of": stream, "group": group, "groups": groups, "members": live[stream]}
    return found


def _member_lines(group: dict[str, Any] | None) -> list[str]:
    if group is None:
        return []
    members = ", ".join(group["members"]) or "none"
    return [
        f"  partition group {group['group']} of {group['groups']} of stream {group['group_of']}; "
        f"live members: {members}"
    ]


def _lag_lines(last: EpochCertificate | None) -> list[str]:
    """How far the source's head was ahead of the last certificate, when that epoch's read ended."""
    if last is None:
        return []
    if not last.lag:
        return [f"  lag: unknown (the source does not say where its head is; certified {last.created_at})"]
    return [f"  lag at epoch {last.sequence} (certified {last.created_at}):"] + [
        f"    {item.describe()}" for item in last.lag
    ]


def _lag_dict(last: EpochCertificate | None) -> dict[str, Any]:
    lag = [] if last is None else last.lag
    return {
        "lag": [
            {
                "domain": str(item.domain),
                "position": item.position,
                "head": item.head,
                "behind": item.behind,
                "unit": item.unit,
                "seconds": item.seconds,
            }
            for item in lag
        ],
        "lag_certified_at": None if last is None else last.created_at,
    }


def _release_command(args: argparse.Namespace) -> int:
    with StateStore(args.state_url) as store:
        before = store.release(args.stream, unless_live=not args.force)
    if not args.force and before.held_by_live_worker:
        refusal = (
            f"not released: {args.stream} is not marked uncertain and {before.owner} holds a live lease "
            f"on it (token {before.fencing_token}, {before.lease_seconds_left:.0f}s left); another worker "
            f"taking it over now would write beside {before.owner}. Stop that worker or let its lease "
            "expire, or pass --force"
        )
        print("\n".join(fit_line(refusal, terminal_width())), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"released": args.stream, "before": before.to_dict()}, indent=2))
        return 0
    was = []
    if before.uncertain:
        was.append(f"marked uncertain ({before.uncertain_reason})")
    if before.owner is not None:
        was.append(f"leased to {before.owner} (token {before.fencing_token})")
    released = (
        f"released {args.stream}: it was {' and '.join(was) if was else 'neither uncertain nor leased'}"
    )
    print("\n".join(fit_line(released, terminal_width())))
    return 0


def _describe(status: StreamStatus) -> str:
    if status.owner is None:
        lease = "not leased"
    elif status.lease_live and status.lease_seconds_left is not None:
        lease = (
            f"leased to {status.owner} (token {status.fencing_token}, {status.lease_seconds_left:.0f}s left)"
        )
    else:
        lease = f"lease of {status.owner} expired (token {status.fencing_token})"
    if status.handover_to is not None and status.lease_live:
        lease += f"; asked to hand over to {status.handover_to}"
    lines = [
        f"{status.stream}: {lease}",
        f"  uncertain: {'yes: ' + (status.uncertain_reason or '') if status.uncertain else 'no'}",
        f"  last certified epoch: {status.last_sequence} (reported to Dagster: {status.reported_through})",
        f"  dead letters: {status.dead_letters}",
    ]
    lines.extend(f"  {position.domain}: {position.value}" for position in status.positions)
    return "\n".join(lines)
