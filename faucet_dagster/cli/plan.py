"""``faucet plan``: check a source/sink pair before anything runs.

Sources and sinks are named as installed connectors (built from a config file, without connecting)
or described by their capabilities directly, from flags or a YAML file. Exit codes: 0 accepted,
1 refused by the planner, 2 bad input.
"""

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from faucet_dagster.cli.files import parse_flag_value, read_yaml
from faucet_dagster.cli.terminal import fit_text, terminal_width
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    Mode,
    PlanError,
    SinkCapabilities,
    SourceCapabilities,
    WritePolicy,
    get_connector,
    sink_capabilities_from,
    source_capabilities_from,
)

EXIT_REFUSED = 1


def add_plan_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``plan`` to the ``faucet`` command line."""
    plan_parser = commands.add_parser(
        "plan",
        help="check a source/sink pair and print the delivery guarantee, or every violation",
        description="Check a source/sink pair before anything runs, and print its delivery guarantee or "
        "every rule it breaks. Name each side by an installed connector (with its config) or by its "
        "capabilities; flags override the YAML file's values. Exit codes: 0 accepted, 1 refused, "
        "2 bad input.",
    )
    plan_parser.add_argument(
        "-f", "--file", type=Path, help="a YAML file with one pair, or a list of them under pairs:"
    )
    plan_parser.add_argument("--source", help="an installed connector name")
    plan_parser.add_argument("--sink", help="an installed connector name")
    plan_parser.add_argument("--source-config", type=Path, help="YAML/JSON config of the source connector")
    plan_parser.add_argument("--sink-config", type=Path, help="YAML/JSON config of the sink connector")
    plan_parser.add_argument(
        "--set-source", action="append", default=[], metavar="FIELD=VALUE", help="set a source capability"
    )
    plan_parser.add_argument(
        "--set-sink", action="append", default=[], metavar="FIELD=VALUE", help="set a sink capability"
    )
    plan_parser.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        metavar="MODE",
        help="bounded (a sync) or continuous (a stream)",
    )
    plan_parser.add_argument(
        "--policy",
        choices=[p.value for p in WritePolicy],
        metavar="POLICY",
        help=f"how the sink writes: {', '.join(p.value for p in WritePolicy)}",
    )
    plan_parser.add_argument("--key", help="comma-separated key columns")
    plan_parser.add_argument(
        "--delivery",
        choices=[d.value for d in Delivery],
        metavar="DELIVERY",
        help=f"the guarantee to insist on: {', '.join(d.value for d in Delivery)}",
    )
    plan_parser.add_argument(
        "--dead-letter", action="store_true", default=None, help="a dead-letter route is set"
    )
    plan_parser.add_argument("--json", action="store_true", help="print JSON")
    plan_parser.set_defaults(handler=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    pairs = _load_pairs(args.file) if args.file else [{"name": "pair"}]
    if len(pairs) > 1 and any((args.source, args.sink, args.set_source, args.set_sink)):
        raise ConfigError(
            "flags that name a source or sink apply to a file with one pair only", where=str(args.file)
        )
    results: list[dict[str, Any]] = []
    refused = False
    for pair in pairs:
        merged = _merge_flags(pair, args)
        name = str(merged.get("name", "pair"))
        try:
            accepted = _plan_pair(merged)
        except PlanError as exc:
            refused = True
            results.append(
                {
                    "name": name,
                    "accepted": False,
                    "violations": [
                        {"code": v.code, "rule": v.rule, "message": v.message} for v in exc.violations
                    ],
                }
            )
        else:
            results.append(
                {"name": name, "accepted": True, "plan": accepted.to_dict(), "summary": accepted.summary()}
            )
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        for result in results:
            _print_result(result)
    return EXIT_REFUSED if refused else 0


def _print_result(result: Mapping[str, Any]) -> None:
    if result["accepted"]:
        lines = [f"{result['name']}: accepted, {result['summary']}"]
    else:
        violations = result["violations"]
        lines = [f"{result['name']}: refused ({len(violations)} violation(s))"] + [
            f"  [{violation['code']}] rule {violation['rule']}: {violation['message']}"
            for violation in violations
        ]
    print(fit_text("\n".join(lines), terminal_width()))


def _load_pairs(path: Path) -> list[dict[str, Any]]:
    data = read_yaml(path)
    if "pairs" in data:
        pairs = data["pairs"]
        if not isinstance(pairs, list) or not all(isinstance(pair, dict) for pair in pairs):
            raise ConfigError("`pairs` must be a list of mappings", where=str(path))
        return [dict(pair) for pair in pairs]
    return [data]


def _merge_flags(pair: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    merged = dict(pair)
    for side in ("source", "sink"):
        spec = dict(merged.get(side) or {})
        connector = getattr(args, side)
        config_path = getattr(args, f"{side}_config")
        if connector:
            spec["connector"] = connector
        if config_path:
            spec["config"] = read_yaml(config_path)
        for assignment in getattr(args, f"set_{side}"):
            field, sep, value = assignment.partition("=")
            if not sep:
                raise ConfigError(f"--set-{side} takes FIELD=VALUE, got no '=' in it")
            spec.setdefault("capabilities", {})[field.strip()] = parse_flag_value(value)
        merged[side] = spec
    for option in ("mode", "policy", "delivery"):
        if getattr(args, option):
            merged[option] = getattr(args, option)
    if args.key is not None:
        merged["key"] = [part.strip() for part in args.key.split(",") if part.strip()]
    if args.dead_letter:
        merged["dead_letter"] = True
    return merged


def _plan_pair(pair: Mapping[str, Any]) -> Plan:
    mode = _enum(Mode, pair.get("mode"), "mode")
    policy = _enum(WritePolicy, pair.get("policy"), "policy")
    delivery_raw = pair.get("delivery")
    delivery = None if delivery_raw is None else _enum(Delivery, delivery_raw, "delivery")
    key = pair.get("key") or []
    if isinstance(key, str):
        key = [part.strip() for part in key.split(",") if part.strip()]
    return plan(
        _source_capabilities(pair.get("source"), mode),
        _sink_capabilities(pair.get("sink"), mode),
        mode,
        policy,
        tuple(str(column) for column in key),
        delivery=delivery,
        durable_state=bool(pair.get("durable_state", True)),
        dead_letter=bool(pair.get("dead_letter", False)),
    )


def _enum(kind: Any, raw: Any, name: str) -> Any:
    if raw is None:
        raise ConfigError(f"the pair needs a {name} ({', '.join(item.value for item in kind)})")
    try:
        return kind(str(raw).lower())
    except ValueError:
        raise ConfigError(
            f"{name} {raw!r} is not one of {', '.join(item.value for item in kind)}", where=name
        ) from None


def _source_capabilities(spec: Any, mode: Mode) -> SourceCapabilities:
    spec = _side_spec(spec, "source")
    overrides = spec.get("capabilities") or {}
    if "connector" not in spec:
        return source_capabilities_from(overrides)
    connector = get_connector(str(spec["connector"]))
    config = spec.get("config") or {}
    base = (
        connector.source(config).capabilities()
        if mode is Mode.BOUNDED
        else connector.stream_source(config).capabilities()
    )
    return source_capabilities_from({**_as_plain(base), **overrides}) if overrides else base


def _sink_capabilities(spec: Any, mode: Mode) -> SinkCapabilities:
    spec = _side_spec(spec, "sink")
    overrides = spec.get("capabilities") or {}
    if "connector" not in spec:
        return sink_capabilities_from(overrides)
    connector = get_connector(str(spec["connector"]))
    config = spec.get("config") or {}
    base = (
        connector.sink(config).capabilities()
        if mode is Mode.BOUNDED
        else connector.streaming_sink(config).capabilities()
    )
    return sink_capabilities_from({**_as_plain(base), **overrides}) if overrides else base


def _side_spec(spec: Any, side: str) -> dict[str, Any]:
    if not isinstance(spec, Mapping) or not ({"connector", "capabilities"} & set(spec)):
        raise ConfigError(
            f"the pair needs a {side}: an installed `connector` (with `config`) or `capabilities`"
        )
    return dict(spec)


def _as_plain(capabilities: SourceCapabilities | SinkCapabilities) -> dict[str, Any]:
    """Capabilities as plain data that ``*_capabilities_from`` reads back."""
    plain: dict[str, Any] = {}
    for name, value in vars(capabilities).items():
        if isinstance(value, frozenset):
            plain[name] = sorted(str(item) for item in value)
        elif isinstance(value, Mapping):
            plain[name] = {str(k): sorted(str(op) for op in v) for k, v in value.items()}
        elif hasattr(value, "total_seconds"):
            plain[name] = value.total_seconds()
        elif value is None or isinstance(value, bool | int | float | tuple):
            plain[name] = list(value) if isinstance(value, tuple) else value
        else:
            plain[name] = str(value)
    return plain
