"""The ``faucet`` command line: ``faucet plan`` checks a source/sink pair before anything runs.

Sources and sinks are named as installed connectors (built from a config file, without connecting)
or described by their capabilities directly, from flags or a YAML file. Exit codes: 0 accepted,
1 refused by the planner, 2 bad input.
"""

import argparse
import importlib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from faucet_dagster.cdc_cli import add_cdc_parser
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    FaucetError,
    Mode,
    PlanError,
    SinkCapabilities,
    SourceCapabilities,
    WritePolicy,
    get_connector,
    sink_capabilities_from,
    source_capabilities_from,
)
from faucet_dagster.state.cli import add_streams_parser

EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except FaucetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faucet", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser(
        "plan",
        help="check a source/sink pair and print the delivery guarantee, or every violation",
        description="Check a source/sink pair. Flags override the YAML file's values.",
    )
    plan_parser.add_argument("-f", "--file", type=Path, help="YAML file with one pair, or `pairs:` a list")
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
    plan_parser.add_argument("--mode", choices=[m.value for m in Mode])
    plan_parser.add_argument("--policy", choices=[p.value for p in WritePolicy])
    plan_parser.add_argument("--key", help="comma-separated key columns")
    plan_parser.add_argument("--delivery", choices=[d.value for d in Delivery])
    plan_parser.add_argument(
        "--dead-letter", action="store_true", default=None, help="a dead-letter route is set"
    )
    plan_parser.add_argument("--json", action="store_true", help="print JSON")
    plan_parser.set_defaults(handler=_plan_command)
    add_streams_parser(commands)
    add_cdc_parser(commands)
    _add_check_parser(commands)
    _add_partitions_parser(commands)
    # Imported here: the battery imports this module's `faucet plan` to check refusals.
    from faucet_dagster.conformance.cli import add_conformance_parser

    add_conformance_parser(commands)
    return parser


def _add_check_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "check",
        help="connect to every connection of a code location and plan every pair",
        description="Import a code location, connect to every connection of its faucet syncs and "
        "streams (secrets from the environment), check what each names exists, plan each pair, and "
        "print a table. Exit codes: 0 every check passed, 1 one failed, 2 bad input.",
    )
    parser.add_argument("-m", "--module", required=True, help="the code location's module (Dagster's -m)")
    parser.add_argument("-d", "--working-directory", type=Path, default=Path.cwd())
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds each connector's check may take")
    parser.set_defaults(handler=_dagster_command("faucet_dagster.check_cli", "check_command"))


def _add_partitions_parser(commands: Any) -> None:
    parser = commands.add_parser("partitions", help="the dynamic partitions of sharded syncs")
    actions = parser.add_subparsers(dest="action", required=True)
    refresh = actions.add_parser(
        "refresh",
        help="add a partition for each new shard of every sharded sync of a code location",
        description="Evaluate every faucet partitions sensor of the code location once, against the "
        "instance of $DAGSTER_HOME, and add the partitions they request.",
    )
    refresh.add_argument("-m", "--module", required=True, help="the code location's module (Dagster's -m)")
    refresh.add_argument("-a", "--attribute", default="defs", help="its Definitions (default: defs)")
    refresh.add_argument("-d", "--working-directory", type=Path, default=Path.cwd())
    refresh.set_defaults(handler=_dagster_command("faucet_dagster.partitions", "refresh_command"))


def _dagster_command(module: str, name: str) -> Any:
    """A handler imported when it runs: these commands load Dagster, which `faucet plan` does not."""

    def handler(args: argparse.Namespace) -> int:
        code: int = getattr(importlib.import_module(module), name)(args)
        return code

    return handler


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
        print(f"{result['name']}: accepted, {result['summary']}")
        return
    violations = result["violations"]
    print(f"{result['name']}: refused ({len(violations)} violation(s))")
    for violation in violations:
        print(f"  [{violation['code']}] rule {violation['rule']}: {violation['message']}")


def _load_pairs(path: Path) -> list[dict[str, Any]]:
    data = _read_yaml(path)
    if "pairs" in data:
        pairs = data["pairs"]
        if not isinstance(pairs, list) or not all(isinstance(pair, dict) for pair in pairs):
            raise ConfigError("`pairs` must be a list of mappings", where=str(path))
        return [dict(pair) for pair in pairs]
    return [data]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", where=str(path)) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}", where=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping", where=str(path))
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong with a YAML text and where (line and column), never the text itself: PyYAML's
    own message quotes the offending line, which may hold a secret."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        # A problem may quote content (an undefined alias, an unknown tag): keep only quoted tokens of
        # one character or PyYAML's <token names>.
        problem = re.sub(r"'(?!<)[^']{2,}'", "'...'", exc.problem or exc.context or "malformed")
        if mark is not None:
            return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        return problem
    return type(exc).__name__


def _merge_flags(pair: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    merged = dict(pair)
    for side in ("source", "sink"):
        spec = dict(merged.get(side) or {})
        connector = getattr(args, side)
        config_path = getattr(args, f"{side}_config")
        if connector:
            spec["connector"] = connector
        if config_path:
            spec["config"] = _read_yaml(config_path)
        for assignment in getattr(args, f"set_{side}"):
            field, sep, value = assignment.partition("=")
            if not sep:
                raise ConfigError(f"--set-{side} takes FIELD=VALUE, got no '=' in it")
            spec.setdefault("capabilities", {})[field.strip()] = _parse_flag_value(value)
        merged[side] = spec
    for option in ("mode", "policy", "delivery"):
        if getattr(args, option):
            merged[option] = getattr(args, option)
    if args.key is not None:
        merged["key"] = [part.strip() for part in args.key.split(",") if part.strip()]
    if args.dead_letter:
        merged["dead_letter"] = True
    return merged


def _parse_flag_value(value: str) -> Any:
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"a --set value is not valid YAML: {yaml_problem(exc)}") from None
    if isinstance(parsed, str) and "," in parsed:
        return [part.strip() for part in parsed.split(",") if part.strip()]
    return parsed


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


if __name__ == "__main__":
    sys.exit(main())
