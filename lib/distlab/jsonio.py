"""Strict JSON text, the one way the library writes JSON that a file or a program reads.

Python's json writes NaN and Infinity bare, which JSON does not have: a strict reader (jq, a browser,
another language's parser) rejects the whole file. `strict_json` writes them as null instead. A reader
that must tell a non-finite number from a missing one needs a mark beside it (the step log's
"non_finite", distlab.metrics.StepLog). Standard library only, so every layer can import it.

Digests stay on plain json.dumps: their bytes key caches already on disk, and no parser ever reads
them back, so a bare NaN in one harms nothing (tests/unit/test_strict_json.py lists them, each with why).
"""

from __future__ import annotations

import json
import math
from typing import Any


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON text that every parser reads. NaN and infinities (at any depth) become null, and anything
    else json cannot write becomes its str(); `kwargs` go to json.dumps (indent, sort_keys, ...)."""
    return json.dumps(_finite(obj), allow_nan=False, default=str, **kwargs)


def non_finite_fields(record: dict[str, Any]) -> list[str]:
    """The top-level fields of `record` whose value is a non-finite float (what strict_json nulls)."""
    return [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
