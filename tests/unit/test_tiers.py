"""The tiers (tests/tiers.py, wired in by tests/conftest.py): a test's folder is its marker, the tiers past unit are
slow, a test outside every tier is refused, and an unmarked test whose call outlasts the limit fails in one line
naming it. Shown on planted tests in a temporary tree (pytester) under a copy of the real conftest.py whose limit is
cut to 0.1 s, so that planted tests of a quarter of a second cross it and this test stays short."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).parents[1] / "conftest.py"
LIMIT = "UNMARKED_LIMIT_S = 5.0"
NAP_S = 0.25  # each planted slow test: over the cut limit, whatever the machine, and short

UNIT = f"""
import time

import pytest


def test_quick(request):
    assert request.node.get_closest_marker("unit") and not request.node.get_closest_marker("slow")


def test_over_the_limit():
    time.sleep({NAP_S})


@pytest.mark.slow
def test_marked_slow():
    time.sleep({NAP_S})


@pytest.fixture
def slow_fixture():
    time.sleep({NAP_S})


def test_with_a_slow_fixture(slow_fixture):
    pass


def test_failing_slowly():
    time.sleep({NAP_S})
    assert 1 == 2, "its own failure"
"""

LAUNCHES = f"""
import time


def test_a_launch(request):
    assert request.node.get_closest_marker("launches") and request.node.get_closest_marker("slow")
    time.sleep({NAP_S})
"""


@pytest.fixture
def planted(pytester):
    """A tests/ folder of its own: the real conftest.py (limit cut to 0.1 s), a unit and a launches test file."""
    text = CONFTEST.read_text()
    assert text.count(LIMIT) == 1, f"conftest.py no longer says {LIMIT!r}: update this test"
    pytester.makeconftest(text.replace(LIMIT, "UNMARKED_LIMIT_S = 0.1"))
    pytester.makeini("[pytest]\nmarkers =\n    slow: planted\n")
    for tier, source in (("unit", UNIT), ("launches", LAUNCHES)):
        (pytester.path / tier).mkdir()
        (pytester.path / tier / f"test_planted_{tier}.py").write_text(source)
    return pytester


def test_an_unmarked_test_over_the_limit_fails_in_one_line_naming_it(planted):
    result = planted.runpytest("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=4, failed=2)  # quick, marked slow, slow fixture, the launch; over, failing
    result.stdout.fnmatch_lines([  # the report is that one line; a test's own failure stays its own
        "unit/test_planted_unit.py::test_over_the_limit took 0.* s, over the 0.1 s an unmarked test may take: "
        "mark it slow or make it faster",
        "E       AssertionError: its own failure",
        "FAILED unit/test_planted_unit.py::test_over_the_limit*",
        "FAILED unit/test_planted_unit.py::test_failing_slowly*",
    ])


def test_the_fast_tier_is_unit_less_what_is_slow(planted):
    result = planted.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", "-m", "not slow")
    result.stdout.fnmatch_lines(["*4/6 tests collected (2 deselected)*"])
    assert "test_marked_slow" not in result.stdout.str() and "test_a_launch" not in result.stdout.str()


def test_a_test_outside_every_tier_is_refused(planted):
    planted.makepyfile(test_loose="def test_loose():\n    pass\n")
    result = planted.runpytest("-p", "no:cacheprovider", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_loose.py::test_loose: a test sits in one of tests/{unit,launches,notebooks,"
                                 "clusters}/ (tests/tiers.py says which)"])


def test_a_child_process_a_test_left_running_is_killed_at_the_end(planted, monkeypatch):
    """Else multiprocessing's exit handler waits for it: the suite never ends (CI ran out of time so once). Run in
    a process of its own, whose exit is the point."""
    monkeypatch.setenv("PYTHONPATH", str(CONFTEST.parent))  # tests/tiers.py, which the conftest imports
    (planted.path / "unit" / "test_planted_unit.py").write_text(
        "import multiprocessing, time\n\n\n"
        "def test_leaves_a_child():\n"
        "    multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,), name='sleeper').start()\n")
    result = planted.runpytest_subprocess("-p", "no:cacheprovider", "unit", timeout=60)
    result.assert_outcomes(passed=1)
    result.stderr.fnmatch_lines(["[[]conftest[]] killed sleeper (pid *): a test left it running"])
