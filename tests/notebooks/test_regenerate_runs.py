"""python -m distlab.publish.regenerate with real kernels: failure reporting, and no orphaned processes.

The fixture notebooks (tests/fixtures/notebooks) start long-lived children before failing or
hanging: one with subprocess.Popen (it stays in the kernel's process group) and one through
distlab.launch.process from a background thread (a session of its own, so killing the kernel's group does
not reach it). Both must be gone once regenerate returns. Order and profiles, no kernel needed:
tests/unit/test_regenerate.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from distlab.publish import regenerate

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "notebooks"


def _notebooks(tmp_path: Path, *names: str) -> tuple[Path, Path]:
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    for name in names:
        shutil.copy(FIXTURES / name, nbdir / name)
    pid_dir = tmp_path / "pids"
    (nbdir / "profiles.yaml").write_text(f'quick:\n  "*":\n    pid_dir: "{pid_dir}"\n')
    return nbdir, pid_dir


def _regenerate(tmp_path: Path, nbdir: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, DISTLAB_BUILD=str(tmp_path / "build"), DISTLAB_FIGURES=str(tmp_path / "figures"))
    cmd = [sys.executable, "-m", "distlab.publish.regenerate", "--profile", "quick", "--notebooks-dir", str(nbdir),
           "--out-dir", str(tmp_path / "book_notebooks"), "--work-dir", str(tmp_path / "work"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def recorded_pids():
    """The pids the notebooks wrote; whatever still runs at the end is killed (no leak on failure)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def _read_pids(pid_dir: Path, recorded: list[int]) -> dict[str, int]:
    found = {}
    for name in ("popen.pid", "runner.pid"):
        path = pid_dir / name
        assert path.exists(), f"the notebook never wrote {path} (kernel too slow to start?)"
        found[name] = int(path.read_text())
        recorded.append(found[name])
    return found


def _assert_gone(pids: dict[str, int], within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    alive = {k: p for k, p in pids.items() if _alive(p)}
    assert not alive, f"processes started by the notebook outlived regenerate: {alive}"


# ----------------------------------------------------------------------------- real kernels


def test_failure_is_named_others_still_run_and_children_are_killed(tmp_path, recorded_pids):
    nbdir, pid_dir = _notebooks(tmp_path, "01_quick_ok.ipynb", "02_deliberate_failure.ipynb")
    proc = _regenerate(tmp_path, nbdir)
    out = proc.stdout + proc.stderr
    pids = _read_pids(pid_dir, recorded_pids)

    assert proc.returncode == 1, out
    # The message names the notebook, the cell (index in the source notebook + first source line)
    # and the exception.
    assert "02_deliberate_failure" in out
    assert "cell 3" in out, out
    assert 'raise RuntimeError("deliberate failure")' in out
    assert "RuntimeError: deliberate failure" in out
    assert "[1/2] 01_quick_ok ... ok" in proc.stdout

    # The good notebook ran (with the profile's environment) and is in the book input.
    good = tmp_path / "book_notebooks" / "01_quick_ok.ipynb"
    nb = nbformat.read(good, as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "hello profile quick" in printed
    # The failed one is kept for inspection, not in the book input.
    assert not (tmp_path / "book_notebooks" / "02_deliberate_failure.ipynb").exists()
    failed = tmp_path / "work" / "failed" / "02_deliberate_failure.ipynb"
    assert failed.exists()
    cell = regenerate.find_failing_cell(failed)
    assert (cell.index, cell.ename, cell.evalue) == (3, "RuntimeError", "deliberate failure")

    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert [(n["name"], n["status"]) for n in summary["notebooks"]] == [
        ("01_quick_ok", "ok"), ("02_deliberate_failure", "failed")]
    assert summary["notebooks"][1]["failing_cell"]["first_line"] == 'raise RuntimeError("deliberate failure")'

    # Both long-lived children (the kernel's own and the one in a session of its own) are gone.
    _assert_gone(pids)


def test_timeout_kills_the_notebook_and_its_children(tmp_path, recorded_pids):
    nbdir, pid_dir = _notebooks(tmp_path, "03_sleeps_forever.ipynb")
    t0 = time.monotonic()
    proc = _regenerate(tmp_path, nbdir, "--timeout-s", "15")
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    pids = _read_pids(pid_dir, recorded_pids)

    assert proc.returncode == 1, out
    assert "03_sleeps_forever" in out and "timed out" in out, out
    assert "cell 3 was still running" in out and "while True:" in out, out
    assert elapsed < 60, f"regenerate took {elapsed:.0f}s for a 15 s limit"
    assert (tmp_path / "work" / "failed" / "03_sleeps_forever.ipynb").exists()
    assert json.loads((tmp_path / "work" / "summary.json").read_text())["notebooks"][0]["status"] == "timeout"
    _assert_gone(pids)
