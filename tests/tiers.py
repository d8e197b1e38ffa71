"""The test tiers and the time limit of an unmarked test: the logic of tests/conftest.py's hooks, in a module of its
own so that tests/unit/test_tiers.py can run it on planted tests with a limit of its own.

A test's tier is the folder it sits in under tests/, and a marker of that name:

  unit       one process, or short helper processes (git, bash -n, shellcheck, a stub script, a command's error
             path): pure functions, planners, parsers, in-process model checks. `make test-fast` runs them, less
             the few marked slow by hand (a short training, a fresh interpreter: seconds each).
  launches   torchrun and other multi-process launches of training, inference, benchmarks and generated scripts
  notebooks  papermill runs of notebooks, the book build
  clusters   the emulated LAN's network namespaces, the one-machine Slurm cluster, Kubernetes pods run locally

Every test in launches, notebooks and clusters is also marked `slow` (left out by `make test-fast`, run by
`make test`). A test file outside the four folders is refused, so that no test escapes its tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = {
    "unit": "in one process (or short helper processes): the tier `make test-fast` runs (tests/unit)",
    "launches": "torchrun and multi-process launches of training, inference and scripts (tests/launches; slow)",
    "notebooks": "papermill runs of notebooks and the book build (tests/notebooks; slow)",
    "clusters": "emulated LAN namespaces, the Slurm cluster, Kubernetes pods run locally (tests/clusters; slow)",
}
SLOW_TIERS = ("launches", "notebooks", "clusters")


def tier_of(path: Path, root: Path) -> str | None:
    """The tier of a test file under `root` (tests/): the first folder of its path there, if it is one."""
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def register(config: pytest.Config) -> None:
    for name, doc in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def mark(items: list[pytest.Item], root: Path) -> None:
    """Give each test its tier's marker, and `slow` in the tiers past unit; refuse a test outside every tier."""
    for item in items:
        tier = tier_of(item.path, root)
        if tier is None:
            if Path(item.path).is_relative_to(root):
                raise pytest.UsageError(f"{item.nodeid}: a test sits in one of tests/{{{','.join(TIERS)}}}/ "
                                        f"(tests/tiers.py says which)")
            continue
        item.add_marker(tier)
        if tier in SLOW_TIERS:
            item.add_marker("slow")


def over_the_limit(item: pytest.Item, report: pytest.TestReport, limit_s: float) -> str | None:
    """The one line that fails `item`, or None: a passed call phase (the test itself: not its fixtures' setup or
    teardown) longer than `limit_s` in a test not marked slow."""
    if report.when != "call" or not report.passed or report.duration <= limit_s:
        return None
    if item.get_closest_marker("slow") is not None:
        return None
    return (f"{item.nodeid} took {report.duration:.1f} s, over the {limit_s:g} s an unmarked test may take: "
            f"mark it slow or make it faster")


def hold_to_the_limit(item: pytest.Item, report: pytest.TestReport, limit_s: float) -> pytest.TestReport:
    """`report`, turned into a failure with over_the_limit's line when the test passed too slowly."""
    line = over_the_limit(item, report, limit_s)
    if line is not None:
        report.outcome = "failed"
        report.longrepr = line
    return report
