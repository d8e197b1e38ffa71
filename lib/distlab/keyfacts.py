"""Key-fact accuracy: does an answer state the facts it must (system names, amounts, deadlines, menu paths)?

A prompt row may carry `facts`, a list of strings. A fact counts when it appears in the answer,
case-insensitively and with runs of whitespace treated as one space (a model that wraps a menu path over
two lines still states it). Accuracy is facts found / facts asked, over all rows that carry facts.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

_SPACE = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _SPACE.sub(" ", str(text)).strip().casefold()


def facts_of(row: Mapping[str, Any]) -> list[str]:
    """The row's `facts` list ([] without one); anything but a list of non-empty strings is an error."""
    facts = row.get("facts")
    if facts is None:
        return []
    if not isinstance(facts, list) or not all(isinstance(f, str) and f.strip() for f in facts):
        raise ValueError(f"row {row.get('id', '?')}: `facts` must be a list of non-empty strings, got {facts!r}")
    return facts


def facts_found(answer: str, facts: Sequence[str]) -> list[bool]:
    """For each fact, whether the answer states it."""
    text = _norm(answer)
    return [_norm(f) in text for f in facts]


def score_rows(prompts: Iterable[Mapping[str, Any]], answers: Mapping[str, str]) -> dict[str, Any]:
    """Key-fact accuracy of `answers` ({row id: answer text}) over the prompt rows that carry facts.

    Returns {"accuracy": found / asked (None when no row has facts), "found", "asked", "rows": [{id, found,
    asked, missing}]}. A prompt row with facts but no answer is an error, not a zero."""
    rows, found, asked = [], 0, 0
    for row in prompts:
        facts = facts_of(row)
        if not facts:
            continue
        rid = row.get("id")
        if rid not in answers:
            raise ValueError(f"no answer for prompt {rid!r}, which carries facts")
        hits = facts_found(answers[rid], facts)
        rows.append({"id": rid, "found": sum(hits), "asked": len(facts),
                     "missing": [f for f, hit in zip(facts, hits) if not hit]})
        found, asked = found + sum(hits), asked + len(facts)
    return {"accuracy": found / asked if asked else None, "found": found, "asked": asked, "rows": rows}
