"""What `faucet` prints for people: help in plain text, and tables that fit the terminal without losing
a character of what they say."""

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from faucet_dagster.cli.main import _parser, main
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.state.store import StateStore

MARKUP = re.compile(r"``|`|:(?:mod|func|class|meth|attr|data):")
"""reStructuredText (a docstring's markup) that a terminal shows as noise."""


def parsers(
    parser: argparse.ArgumentParser, path: str = "faucet"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand's parser under it, with the command that reaches it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, f"{path} {name}")


def test_every_command_explains_itself_in_plain_text() -> None:
    found = dict(parsers(_parser()))
    assert {"faucet plan", "faucet check", "faucet streams status", "faucet conformance"} <= set(found)
    for command, parser in found.items():
        text = parser.format_help()
        assert not MARKUP.search(text), f"{command} --help shows markup:\n{text}"
        assert parser.description, f"{command} --help says nothing about what it does"
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{command} {'/'.join(action.option_strings)} has no help"


def test_help_fits_an_80_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    for command, parser in parsers(_parser()):
        text = parser.format_help()
        assert max(map(len, text.splitlines())) <= 80, f"{command} --help:\n{text}"


def printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: int | None, *args: str
) -> tuple[int, str]:
    """What ``faucet ARGS`` prints to a terminal of ``columns`` (None: to a pipe), and its exit code."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    code = main(list(args))
    return code, capsys.readouterr().out


CODE_LOCATION = """\
import dagster as dg
from faucet_dagster import FaucetConnection, FaucetSync, faucet_sync_assets

HERE = {here!r}
orders = FaucetSync(
    name="orders_from_the_landing_area",
    source=FaucetConnection(connector="files").using(paths=[HERE + "/landing/orders/of/every/shop/*.csv"]),
    sink=FaucetConnection(connector="sql", config={{"url": "sqlite:///" + HERE + "/warehouse.db"}}).using(
        table="orders"
    ),
)
defs = dg.Definitions(assets=faucet_sync_assets([orders]))
"""


def grid(output: str) -> list[list[str]]:
    """The cells of the table `faucet check` printed, a row's continuation lines joined back, every cell
    without its whitespace (a wrapped cell breaks at spaces or inside a word)."""
    lines = [line for line in output.splitlines() if line.strip()]
    header = lines[0]
    starts = [match.start() for match in re.finditer(r"\S+", header)]
    rows: list[list[str]] = []
    for line in lines[1:]:
        if re.match(r"^\d+ passed, \d+ failed$", line):
            break
        cells = [line[start:end].strip() for start, end in zip(starts, [*starts[1:], None], strict=True)]
        if cells[1] or not rows:  # the role: one word, on a row's first line only
            rows.append(cells)
        else:
            rows[-1] = [kept + more for kept, more in zip(rows[-1], cells, strict=True)]
    return [[re.sub(r"\s", "", cell) for cell in row] for row in rows]


def test_faucet_check_wraps_long_cells_to_the_terminal_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"shop_location_{tmp_path.name}"
    (tmp_path / f"{module}.py").write_text(CODE_LOCATION.format(here=str(tmp_path / ("deep/" * 8))))
    # This process's declarations are the code location's only, and its import is undone after.
    monkeypatch.setattr(DECLARED, "syncs", {})
    monkeypatch.setattr(DECLARED, "streams", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, module, None)
    del sys.modules[module]
    args = ("check", "-m", module, "-d", str(tmp_path), "--timeout", "30")
    wide_code, wide = printed(capsys, monkeypatch, None, *args)  # to a pipe: one line a row
    narrow_code, narrow = printed(capsys, monkeypatch, 72, *args)
    assert wide_code == narrow_code == 1, wide  # no file matches the source's paths
    assert "FAILED:" in wide
    assert max(map(len, wide.splitlines())) > 150
    assert max(map(len, narrow.splitlines())) <= 72, narrow
    assert len(narrow.splitlines()) > len(wide.splitlines())
    assert grid(narrow) == grid(wide)


def test_faucet_streams_status_wraps_to_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    owner = "worker-" + "x" * 120
    with StateStore(url) as store:
        store.acquire_lease("events", owner, ttl=600)
    _, wide = printed(capsys, monkeypatch, None, "streams", "status", "--state-url", url)
    _, narrow = printed(capsys, monkeypatch, 60, "streams", "status", "--state-url", url)
    assert owner in wide
    assert max(map(len, narrow.splitlines())) <= 60, narrow
    assert len(narrow.splitlines()) > len(wide.splitlines())
    assert re.sub(r"\s", "", narrow) == re.sub(r"\s", "", wide)


def test_faucet_conformance_folds_its_table_to_the_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ("conformance", "sql", "--check", "config_schema", "--check", "capabilities")
    wide_code, wide = printed(capsys, monkeypatch, None, *args)
    narrow_code, narrow = printed(capsys, monkeypatch, 80, *args)
    assert wide_code == narrow_code == 0, wide
    assert max(map(len, wide.splitlines())) > 120
    assert max(map(len, narrow.splitlines())) <= 80, narrow
    # Each block of the folded table repeats the row names; together the blocks hold every column.
    headers = [line for line in narrow.splitlines() if line.startswith("connector role |")]
    assert len(headers) >= 2
    codes = [code.strip() for header in headers for code in header.split("|")[1:]]
    [wide_header] = [line for line in wide.splitlines() if line.startswith("connector role |")]
    assert codes == [code.strip() for code in wide_header.split("|")[1:]]
    for subject in ("sql source", "sql sink"):
        rows = [line for line in narrow.splitlines() if line.startswith(subject + " ") and "|" in line]
        assert len(rows) == len(headers)
        assert sum(row.count("pass") for row in rows) == 2


REFUSED_PAIR = (
    "plan", "--mode", "continuous", "--policy", "replace", "--delivery", "effectively_once",
    "--set-source", "emits=changes", "--set-source", "operations=insert,update,delete",
    "--set-source", "ordering=partition", "--set-source", "replay=best_effort",
    "--set-source", "bounded=true", "--set-source", "continuous=true",
    "--set-sink", "bounded_policies=append,upsert,replace", "--set-sink", "continuous_policies=append",
)  # fmt: skip
"""A pair refused for seven reasons, each a line longer than a terminal (docs/cli.md shows it)."""


def test_lines_to_a_pipe_are_not_wrapped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, wide = printed(capsys, monkeypatch, None, *REFUSED_PAIR)
    assert code == 1, wide
    assert any(len(line) > 120 for line in wide.splitlines()), wide
    _, narrow = printed(capsys, monkeypatch, 80, *REFUSED_PAIR)
    assert max(map(len, narrow.splitlines())) <= 80, narrow
    assert re.sub(r"\s", "", narrow) == re.sub(r"\s", "", wide)
