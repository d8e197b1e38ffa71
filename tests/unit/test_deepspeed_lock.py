"""DeepSpeed's comm op on a reader's machine: what its JIT build needs, and the lock a killed build leaves.

A build killed midway leaves torch's build lock behind, and every later build (or load: torch takes the lock
for a cached op too) would wait for it forever. `make deepspeed-op` and every run remove a lock older than any
real build, leave one that a live process holds, and name a young one that nobody holds in one line, within
seconds. Without a C++ compiler, Python.h or ninja the build would end in a page of compiler output: the run
ends with one line naming what is missing and what to install instead."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from distlab.strategies import deepspeed_runtime as ds

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the fixture below points sys.executable elsewhere; subprocesses need the real one

# A build in another process, as torch runs one: torch's own FileBaton takes the lock and keeps it while it "compiles".
HOLD_LOCK = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(120)
"""


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def _young_orphan_lock(cache: Path) -> Path:
    """A lock as a build killed a moment ago leaves it: younger than any real build, held by nobody."""
    lock = ds.build_lock(cache)
    lock.parent.mkdir(parents=True)
    lock.touch()
    return lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / ds.SHM_OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert ds.remove_stale_build_lock(tmp_path) is None and lock.exists()  # a build may hold it right now
    _age(lock, ds.STALE_LOCK_S + 60)
    assert ds.remove_stale_build_lock(tmp_path) == lock and not lock.exists()
    assert "stale build lock" in capsys.readouterr().out
    assert ds.remove_stale_build_lock(tmp_path) is None  # nothing to remove


def test_a_live_build_keeps_its_lock_and_a_killed_one_is_named_within_seconds(tmp_path, capsys):
    lock = ds.build_lock(tmp_path)
    lock.parent.mkdir()
    builder = subprocess.Popen([PYTHON, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        assert ds.lock_holders(lock) == [builder.pid]
        assert ds.lock_problem(tmp_path, settle_s=0.1) is None and lock.exists()  # the run waits for it
        assert f"process {builder.pid}" in capsys.readouterr().out
        _age(lock, ds.STALE_LOCK_S + 60)  # a build slower than the age limit is still not broken
        assert ds.remove_stale_build_lock(tmp_path) is None and lock.exists()
        assert ds.lock_problem(tmp_path, settle_s=0.1) is None and lock.exists()
        os.utime(lock)  # young again
    finally:
        builder.send_signal(signal.SIGKILL)  # killed midway: the kernel closes the descriptor, the file stays
        builder.wait()
    assert lock.exists() and ds.lock_holders(lock) == []
    t0 = time.monotonic()
    problem = ds.lock_problem(tmp_path)
    assert time.monotonic() - t0 < 10
    assert problem and "\n" not in problem
    assert str(lock) in problem and f"rm {lock}" in problem and lock.exists()
    _age(lock, ds.STALE_LOCK_S + 60)
    assert ds.lock_problem(tmp_path, settle_s=0.1) is None and not lock.exists()  # removed, as make deepspeed-op does


def test_a_finished_build_that_removes_its_lock_while_looked_at_is_no_problem(tmp_path):
    """torch's FileBaton.release closes the descriptor, then deletes the file: in between, nobody holds it."""
    lock = _young_orphan_lock(tmp_path)
    finishing = threading.Timer(0.2, lock.unlink)
    finishing.start()
    assert ds.lock_problem(tmp_path, settle_s=1.0) is None
    finishing.join()


# ----------------------------------------------------------------------------- the toolchain


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """PATH = a new folder of links to the tools named (none of cc, c++, g++, clang++ unless asked), no $CXX,
    and Python's headers in a folder of the test's own (so the machine's own headers decide nothing)."""
    original = os.environ["PATH"]
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").touch()
    monkeypatch.setattr(ds, "python_include_dir", lambda: include)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-venv" / "python"))  # no ninja beside it
    calls = iter(range(100))

    def use(*names: str) -> Path:
        tools = tmp_path / f"tools{next(calls)}"
        tools.mkdir()
        for name in names:
            real = shutil.which(name, path=original)
            assert real, f"this test needs {name} on PATH"
            (tools / name).symlink_to(real)
        monkeypatch.setenv("PATH", str(tools))
        # set, then removed: monkeypatch then removes on teardown the $CXX that preflight sets (a delenv of an
        # absent variable records nothing, and a leaked CXX made every later DeepSpeed build in this pytest
        # process name a temporary g++: the op cache then no longer matched a plain `c++` run)
        monkeypatch.setenv("CXX", "")
        monkeypatch.delenv("CXX")
        return tools

    return use


def _os_release(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "os-release"
    path.write_text(text)
    return path


def test_no_compiler_is_one_line_naming_it_and_the_package(tmp_path, bare_path):
    bare_path("ninja")
    debian = _os_release(tmp_path, 'ID=ubuntu\nID_LIKE="debian"\n')
    problem = ds.toolchain_problem(os_release=debian)
    assert problem is not None and "\n" not in problem
    assert "no C++ compiler (c++, g++ or clang++)" in problem
    assert "sudo apt-get install build-essential" in problem and "python3-dev" not in problem  # headers are there
    fedora = _os_release(tmp_path, "ID=fedora\n")
    assert "sudo dnf install gcc-c++" in ds.toolchain_problem(os_release=fedora)
    unknown = ds.toolchain_problem(os_release=tmp_path / "none")
    assert all(s in unknown for s in ("build-essential", "gcc-c++", "xcode-select --install"))


def test_no_python_headers_names_the_folder_and_the_package(tmp_path, bare_path):
    bare_path("ninja", "g++")
    debian = _os_release(tmp_path, "ID=debian\n")
    problem = ds.toolchain_problem(include=Path("/usr/include/python-none"), os_release=debian)
    assert problem == ("DeepSpeed's communication op cannot be compiled here: no Python.h in /usr/include/python-none; "
                       "to install: sudo apt-get install python3-dev")
    # A Python of its own (pyenv, python.org, conda) ships its headers: python3-dev would not help it
    own = ds.toolchain_problem(include=tmp_path, os_release=debian)
    assert "python3-dev" not in own and f"reinstall the Python at {sys.base_prefix}" in own


def test_a_cxx_that_is_not_there_is_named(tmp_path, bare_path, monkeypatch):
    bare_path("ninja", "g++")
    monkeypatch.setenv("CXX", "ccache-nowhere g++")
    assert "no C++ compiler $CXX ('ccache-nowhere g++')" in ds.toolchain_problem(os_release=tmp_path / "none")


def test_g_plus_plus_alone_is_enough_and_torch_is_told_to_use_it(tmp_path, bare_path, monkeypatch):
    """torch's build runs `c++` unless $CXX says otherwise: where only g++ exists, the run sets $CXX."""
    tools = bare_path("ninja", "g++")
    assert ds.toolchain_problem() is None
    ds.preflight(tmp_path, cold=True)
    assert os.environ["CXX"] == str(tools / "g++")


def test_ninja_beside_the_interpreter_is_found_and_put_on_path(tmp_path, bare_path, monkeypatch):
    """`.venv/bin/python -m ...` without an activated venv: the lock's ninja is in .venv/bin, not on PATH."""
    tools = bare_path("c++")
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "ninja").write_text("#!/bin/sh\n")
    (venv_bin / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert ds.toolchain_problem() is None
    ds.preflight(tmp_path, cold=True)
    assert os.environ["PATH"].split(os.pathsep) == [str(venv_bin), str(tools)]
    bare_path("c++")  # and no ninja anywhere:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert ds.toolchain_problem() == ("DeepSpeed's communication op cannot be compiled here: no ninja; "
                                      "pip install ninja (make env installs it)")


def test_a_warm_cache_needs_no_compiler_but_still_the_lock(tmp_path, bare_path):
    """torch loads a cached op without compiling (it only warns about a missing compiler), but takes the lock."""
    bare_path("ninja")
    ds.preflight(tmp_path, cold=False)
    lock = _young_orphan_lock(tmp_path)
    with pytest.raises(ds.DeepSpeedOpError, match=f"rm {lock}"):
        ds.preflight(tmp_path, cold=False)


# ----------------------------------------------------------------------------- the paths a run takes


@pytest.mark.slow  # imports DeepSpeed (seconds on two busy cores)
def test_a_run_fails_within_seconds_on_a_killed_builds_lock_instead_of_waiting(tmp_path, monkeypatch):
    """init_deepspeed (every ZeRO and DeepSpeed-pipeline rank) checks before DeepSpeed would wait on the lock."""
    import deepspeed

    cache = tmp_path / "cache"
    lock = _young_orphan_lock(cache)
    (cache / ds.SHM_OP / f"{ds.SHM_OP}.so").touch()  # cached: the lock alone stands in the way
    monkeypatch.setattr(ds, "comm_op_needed", lambda: True)

    def would_wait(**_):
        raise AssertionError("DeepSpeed started and would wait on the lock forever")

    monkeypatch.setattr(deepspeed, "init_distributed", would_wait)
    t0 = time.monotonic()
    with pytest.raises(ds.DeepSpeedOpError, match=f"rm {lock}"):
        ds.init_deepspeed(SimpleNamespace(is_main=True, backend="gloo"), cache)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow  # imports DeepSpeed
def test_a_chapter_learns_why_deepspeed_cannot_run(tmp_path, bare_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cold"))
    monkeypatch.setattr(ds, "comm_op_needed", lambda: True)
    bare_path("ninja", "c++")
    assert ds.deepspeed_unavailable_reason() is None
    bare_path("ninja")
    reason = ds.deepspeed_unavailable_reason()
    assert reason == ds.toolchain_problem() and "no C++ compiler" in reason


@pytest.mark.slow  # two interpreters that import DeepSpeed
def test_make_deepspeed_op_without_a_compiler_ends_with_one_line(tmp_path, bare_path):
    """What `make deepspeed-op` runs, with a PATH that has ninja but no compiler: one line, exit 2; with
    --optional (make book) the same reason, exit 0, so the book goes on."""
    tools = bare_path("ninja")
    env = {**os.environ, "PATH": str(tools), "TORCH_EXTENSIONS_DIR": str(tmp_path / "cold")}
    env.pop("CXX", None)
    cmd = [PYTHON, "-m", "distlab.strategies.deepspeed_runtime"]
    strict = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert strict.returncode == 2, strict.stderr[-3000:]
    assert "Traceback" not in strict.stderr
    last = strict.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m distlab.strategies.deepspeed_runtime: error: DeepSpeed's communication op "
                           "cannot be compiled here: no C++ compiler"), strict.stderr[-3000:]
    # the only other stderr line allowed is DeepSpeed's own notice that it picked the CPU accelerator
    assert all("accelerator" in line for line in strict.stderr.strip().splitlines()[:-1]), strict.stderr
    optional = subprocess.run([*cmd, "--optional"], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                              timeout=300)
    assert optional.returncode == 0, optional.stderr[-3000:]
    assert optional.stdout.strip().splitlines()[-1].startswith("skipped: DeepSpeed's communication op cannot be "
                                                               "compiled here: no C++ compiler")
    assert not (tmp_path / "cold" / ds.SHM_OP / f"{ds.SHM_OP}.so").exists()


def test_each_environment_keeps_its_own_build(monkeypatch, tmp_path):
    # A build's build.ninja names its environment's torch and DeepSpeed sources: another clone's venv finding it
    # would compile again (and fail where no compiler is), so the cache folder is the environment's own.
    for var in ("TORCH_EXTENSIONS_DIR", "DISTLAB_TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(var, raising=False)
    here = ds.extensions_dir()
    assert here == ds.extensions_dir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-clone" / ".venv"))
    assert ds.extensions_dir() != here
    assert ds.extensions_dir().parent == here.parent
