"""Reading torch.profiler's chrome trace: the complete events a classifier keeps, as spans in ms.

ddp_trace and fsdp_trace profile different steps and keep different events (their own `classify`), but read
the trace the same way: only complete ("X") events, times from the first event named `origin`.
"""

from __future__ import annotations

from typing import Callable

Classify = Callable[[str], "tuple[str, str] | None"]  # event name -> (kind, shown name), or None to drop it


def spans(chrome_trace: dict, origin: str, classify: Classify) -> list[dict]:
    """The events `classify` keeps, each {kind, name, thread, start_ms, end_ms}, in start order; start_ms
    counts from the first event named `origin`."""
    events = [e for e in chrome_trace.get("traceEvents", []) if e.get("ph") == "X"]
    zero = min(e["ts"] for e in events if e["name"] == origin)
    out = []
    for e in events:
        kept = classify(e["name"])
        if kept is None:
            continue
        start = (e["ts"] - zero) / 1e3
        out.append({"kind": kept[0], "name": kept[1], "thread": e["tid"], "start_ms": start,
                    "end_ms": start + e["dur"] / 1e3})
    return sorted(out, key=lambda s: s["start_ms"])
