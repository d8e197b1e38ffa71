"""`make env` on a reader's machine: a broken or half-made virtual environment, or a Python that cannot make one,
ends with one line saying how to fix it (tools/check_venv.sh, which the Makefile runs before any pip), not with a
traceback from pip or python. Each case drives the real Makefile against a venv planted in a temp folder; every
broken case stops in the check, so no test ever reaches pip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PIP_STEP = "-m pip install"  # what the stamp's recipe echoes once it runs: no broken case may get there


# `make test` runs this suite inside make: its MAKELEVEL would turn the reader's "make: ***" into "make[1]: ***" (and
# MAKEFLAGS would pass make test's flags down), so each case runs make as a reader types it, from a plain shell.
_MAKE_STATE = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")


def _make(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _MAKE_STATE}
    return subprocess.run(["make", "--no-print-directory", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=120)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    """The check's one line: exit 2 from the script (make then says Error 2 and stops), nothing else said,
    and pip never started."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    ours = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("make: *** ")]
    assert len(ours) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and PIP_STEP not in proc.stdout, proc.stdout + proc.stderr
    assert ours[0].startswith("make env: ")
    return ours[0]


def test_a_venv_whose_python_dangles_says_how_to_remake_it(tmp_path):
    """The system Python was upgraded or removed: bin/python points nowhere (and the stamp may still be there)."""
    broken = tmp_path / "broken"
    (broken / "bin").mkdir(parents=True)
    (broken / "bin" / "python").symlink_to("/usr/bin/python3.0-removed")
    (broken / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (broken / ".distlab-installed").touch()  # an up-to-date stamp does not hide it
    line = _one_line(_make("env", f"VENV={broken}", f"PYTHON={sys.executable}"))
    assert "points to /usr/bin/python3.0-removed, which no longer exists" in line
    assert line.endswith(f"rm -rf {broken} && make env")


def test_a_half_made_venv_without_pip_names_python3_venv(tmp_path):
    """What `python3 -m venv` leaves on Debian without python3-venv: bin/python, no pip."""
    half = tmp_path / "half"
    venv.create(half, with_pip=False)
    line = _one_line(_make("env", f"VENV={half}", f"PYTHON={sys.executable}"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"{half} has no pip" in line and f"sudo apt-get install python{version}-venv" in line
    assert line.endswith(f"rm -rf {half} && make env")


def test_a_venv_folder_without_python_is_refused(tmp_path):
    empty_ish = tmp_path / "v"
    empty_ish.mkdir()
    (empty_ish / "pyvenv.cfg").touch()
    assert "no bin/python" in _one_line(_make("venv-check", f"VENV={empty_ish}", f"PYTHON={sys.executable}"))


def test_no_such_python_names_it(tmp_path):
    line = _one_line(_make("env", f"VENV={tmp_path / 'new'}", "PYTHON=python3-not-installed"))
    assert line.startswith("make env: no python3-not-installed on PATH") and "PYTHON=" in line
    assert not (tmp_path / "new").exists()


@pytest.fixture
def python_without_ensurepip(tmp_path) -> Path:
    """A real CPython installation whose standard library lacks ensurepip, as Debian's python3.X is until
    python3.X-venv is installed: this interpreter's binary copied beside a lib/ of links to its standard
    library, ensurepip left out (the new venv's python finds its library from the copy's place)."""
    root = tmp_path / "python-no-ensurepip"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_path("stdlib"))
    lib = root / "lib" / f"python{version}"
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "ensurepip":
            (lib / entry.name).symlink_to(entry)
    libdir = sysconfig.get_config_var("LIBDIR")  # a shared libpython found through $ORIGIN/../lib
    for shared in Path(libdir).glob("libpython*.so*") if libdir else ():
        (root / "lib" / shared.name).symlink_to(shared)
    (root / "bin").mkdir()
    python = root / "bin" / f"python{version}"
    shutil.copy2(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), python)
    probe = subprocess.run([str(python), "-c", "import ensurepip"], capture_output=True, text=True)
    if probe.returncode == 0 or "No module named 'ensurepip'" not in probe.stderr:
        pytest.skip(f"this CPython cannot run from a copy with its library linked ({probe.stderr.strip()[-200:]})")
    return python


def test_a_python_without_ensurepip_names_python3_venv_and_leaves_nothing_behind(tmp_path,
                                                                                 python_without_ensurepip):
    new = tmp_path / "new"
    line = _one_line(_make("env", f"VENV={new}", f"PYTHON={python_without_ensurepip}"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "cannot install pip (ensurepip is not available)" in line
    assert f"sudo apt-get install python{version}-venv" in line and f"uv venv --seed {new}" in line
    assert not new.exists()  # the half-made venv it began is gone: the next make env starts clean


def test_a_working_venv_passes_and_an_up_to_date_one_runs_only_the_check():
    """The project's own .venv (read, never changed: -n prints what would run)."""
    installed = REPO_ROOT / ".venv" / ".distlab-installed"
    if not installed.exists():
        pytest.skip("make env has not finished here")
    check = _make("venv-check", "VENV=.venv", "PYTHON=python3")
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stderr
    newest_input = max((REPO_ROOT / f).stat().st_mtime for f in ("requirements.lock", "pyproject.toml"))
    if installed.stat().st_mtime < newest_input:
        pytest.skip("the stamp is older than the lock: make env would reinstall")
    dry = _make("-n", "env", "VENV=.venv", "PYTHON=python3")
    assert dry.returncode == 0 and dry.stdout.strip().splitlines() == ['bash tools/check_venv.sh ".venv" "python3"']
