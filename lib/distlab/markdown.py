"""Markdown tables from values that come from outside the code (run names, log fields, model answers).

A `|` in a run name splits a table row into extra columns, a newline ends the row, and `<script>` or `&lt;`
in a log field is HTML to the book's renderer: every Markdown table distlab writes goes through `cell` (one
value) or `table` (a DataFrame), so a value is shown as the text it is, on one line, in its own column.
"""

from __future__ import annotations

from typing import Any

_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|"})


def cell(value: Any) -> str:
    """`value` as the text of one table cell: whitespace runs (newlines, CR, tabs) collapsed to one space,
    `|` escaped, `&`, `<` and `>` written as HTML entities."""
    return " ".join(str(value).split()).translate(_ESCAPES)


def table(df, floatfmt: str = ".4g", **kwargs: Any) -> str:
    """df.to_markdown with every text value and column name passed through `cell` (numbers as they are)."""
    shown = df.map(lambda v: cell(v) if isinstance(v, str) else v)
    shown.columns = [cell(c) for c in df.columns]
    return shown.to_markdown(index=False, floatfmt=floatfmt, **kwargs)
