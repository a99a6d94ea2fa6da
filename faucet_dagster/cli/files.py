"""Config files and ``--set`` flags as the commands read them: YAML, with errors that never quote a value."""

import re
from pathlib import Path
from typing import Any

import yaml

from faucet_dagster.protocol import ConfigError


def read_yaml(path: Path) -> dict[str, Any]:
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


def parse_flag_value(value: str) -> Any:
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"a --set value is not valid YAML: {yaml_problem(exc)}") from None
    if isinstance(parsed, str) and "," in parsed:
        return [part.strip() for part in parsed.split(",") if part.strip()]
    return parsed
