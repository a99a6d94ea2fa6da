"""What the commands print, fitted to the terminal: tables whose long cells wrap, and lines that wrap.

Nothing is cut off: a cell or a line too long for the terminal continues on the next line, so an error
message or a position is always read whole. Output that goes to a pipe or a file (no terminal and no
``COLUMNS``) is not wrapped, so that ``grep`` and scripts see one record per line.
"""

import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

GAP = "  "
"""Between two columns of a table."""
MIN_WRAPPED_WIDTH = 12
"""A wrapped column is never made narrower than this (or its header), however narrow the terminal."""


def terminal_width() -> int | None:
    """The columns of the terminal the output goes to, or ``None`` (do not wrap) when it goes to a pipe
    or a file and ``COLUMNS`` is not set."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


@dataclass(frozen=True)
class Column:
    """A table's column: its ``header``, and whether its cells may wrap onto more lines (free text:
    a URI, an error message) or keep their width (a name, a role)."""

    header: str
    wraps: bool = False


def format_grid(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None) -> list[str]:
    """``rows`` under ``columns``, left-aligned, each line at most ``width`` characters when the
    wrapping columns can be narrowed that far (the widest first); ``None``: as wide as the cells."""
    widths = [max([len(column.header), *(len(row[i]) for row in rows)]) for i, column in enumerate(columns)]
    if width is not None:
        _narrow(columns, widths, width)
    lines = [_line([column.header for column in columns], widths)]
    for row in rows:
        cells = [
            _wrap(cell, widths[i]) if column.wraps else [cell]
            for i, (column, cell) in enumerate(zip(columns, row, strict=True))
        ]
        for depth in range(max(len(cell) for cell in cells)):
            lines.append(_line([cell[depth] if depth < len(cell) else "" for cell in cells], widths))
    return lines


def _narrow(columns: Sequence[Column], widths: list[int], width: int) -> None:
    """Narrow the wrapping columns, the widest first, until the table fits ``width`` or none can."""
    floors = [max(len(column.header), MIN_WRAPPED_WIDTH) for column in columns]
    while sum(widths) + len(GAP) * (len(widths) - 1) > width:
        candidates = [i for i, column in enumerate(columns) if column.wraps and widths[i] > floors[i]]
        if not candidates:
            return
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width``, broken at spaces, else after a ``/``, ``#`` or ``,``
    (a URI, a position), else anywhere; every line begins with ``indent`` but the first, which keeps
    ``text``'s own."""
    own = text[: len(text) - len(text.lstrip())]
    pieces = textwrap.wrap(
        text.strip(),
        width,
        initial_indent=own,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )
    lines: list[str] = []
    for piece in pieces or [""]:
        while len(piece) > width:
            lead = len(own) if not lines else len(indent)
            cut = max(piece.rfind(mark, lead, width) for mark in "/#,") + 1
            if cut <= lead + (width - lead) // 3:
                cut = width
            lines.append(piece[:cut])
            piece = indent + piece[cut:]
        lines.append(piece)
    return lines


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return GAP.join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def fit_line(line: str, width: int | None) -> list[str]:
    """``line`` wrapped to ``width``, its continuation lines indented four more than its own indent."""
    if width is None or len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()))
    return _wrap(line, width, indent + "    ")


def fit_text(text: str, width: int | None) -> str:
    """Every line of ``text`` fitted by :func:`fit_line`."""
    return "\n".join(part for line in text.splitlines() for part in fit_line(line, width))


def fold_pipe_table(text: str, width: int | None, separator: str = " | ") -> str:
    """The first table in ``text`` (lines whose cells are joined by ``separator``, the header ruled by
    a line of dashes, up to the first other line), printed in blocks of columns that fit ``width``,
    each block repeating the first column (the row's name); every other line wrapped by
    :func:`fit_line`."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if separator in line), None)
    if width is None or first is None:
        return fit_text(text, width)
    end = first
    while end < len(lines) and (separator in lines[end] or _is_rule(lines[end])):
        end += 1
    table = [lines[i].split(separator) for i in range(first, end) if not _is_rule(lines[i])]
    if all(len(separator.join(cells)) <= width for cells in table):
        return fit_text(text, width)
    widths = [max(len(cells[c]) if c < len(cells) else 0 for cells in table) for c in range(len(table[0]))]
    blocks: list[list[int]] = [[]]
    used = widths[0]
    for column in range(1, len(widths)):
        if blocks[-1] and used + len(separator) + widths[column] > width:
            blocks.append([])
            used = widths[0]
        blocks[-1].append(column)
        used += len(separator) + widths[column]
    out = [part for line in lines[:first] for part in fit_line(line, width)]
    for number, block in enumerate(blocks):
        if number:
            out.append("")
        for position, cells in enumerate(table):
            line = separator.join([cells[0], *(cells[c] for c in block if c < len(cells))])
            out.append(line)
            if position == 0:
                out.append("-" * len(line))
    out += [part for line in lines[end:] for part in fit_line(line, width)]
    return "\n".join(out)


def _is_rule(line: str) -> bool:
    return bool(line) and set(line) == {"-"}


__all__ = ["Column", "fit_line", "fit_text", "fold_pipe_table", "format_grid", "terminal_width"]
