"""distlab.launch's generated scripts run for real through distlab.launch.process (torchrun on CPU, gloo): the
fingerprint job on 2 ranks, a script on a PATH without coreutils' `timeout` (as on macOS), and the script's own
hard limit stopping torchrun and its ranks. What the scripts say (golden files, quoting, bash -n, shellcheck):
tests/unit/test_launch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from distlab.launch import process, torchrun
from distlab.launch.spec import LaunchSpec

# ------------------------------------------------------------------ real runs (torchrun on CPU)

def test_generated_script_runs_the_fingerprint_job(tmp_path):
    spec = LaunchSpec(module="distlab.workers.fingerprint", args=["--out", "fp.json"], nproc_per_node=2,
                      env={"OMP_NUM_THREADS": "1"}, log_dir="logs", timeout_s=150,
                      description="software fingerprint of 2 CPU ranks")
    script = torchrun.write_scripts(spec, tmp_path, "fingerprint")[0]
    lines: list[str] = []
    result = process.run(["bash", str(script)], timeout_s=180, cwd=tmp_path, echo=lines.append,
                        env={"PYTHON": sys.executable}, log_path=tmp_path / "run.log")
    assert result.ok
    report = json.loads((tmp_path / "fp.json").read_text())
    assert report["world_size"] == 2 and report["mismatched_fields"] == []
    assert any(ln.startswith("[default0]:fingerprint: 2 ranks") for ln in lines)
    assert len(list((tmp_path / "logs").rglob("stdout.log"))) == 2  # torchrun --log-dir, one per rank


def path_without_timeout(tmp_path: Path) -> str:
    """A PATH holding only what a generated single-node script calls besides the interpreter: no `timeout`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    assert shutil.which("timeout", path=str(bin_dir)) is None
    return str(bin_dir)


HELLO = 'import os; print(f"hello from rank {os.environ[\'RANK\']} of {os.environ[\'WORLD_SIZE\']}", flush=True)\n'


def test_a_generated_script_runs_where_no_timeout_exists(tmp_path):
    """macOS has no coreutils `timeout`: the script's hard limit must not need one. A real torchrun on CPU."""
    (tmp_path / "hello_mod.py").write_text(HELLO)
    spec = LaunchSpec(module="hello_mod", nproc_per_node=2, log_dir="logs/hello", timeout_s=120, kill_after_s=35,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": "."}, repo_root="..")
    script = torchrun.write_scripts(spec, tmp_path / "launch", "hello")[0]
    env = {**os.environ, "PATH": path_without_timeout(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run([shutil.which("bash"), str(script)], cwd=tmp_path / "launch", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[default{rank}]:hello from rank {rank} of 2" in proc.stdout + proc.stderr
    assert (tmp_path / "logs" / "hello").is_dir()  # the script changed to its repo_root first


SLEEPER = textwrap.dedent("""
    import os, time
    print(f"rank {os.environ['RANK']} PID {os.getpid()}", flush=True)
    time.sleep(300)
""")


def test_hard_limit_stops_torchrun_and_its_ranks(tmp_path):
    """The script's own limit (distlab.launch.watchdog): SIGTERM to torchrun at the limit, which stops its ranks
    (they run in sessions of their own), exit status 124. Here torchrun's shutdown grace is 2 s, not 30. No
    coreutils `timeout` on PATH, as on macOS: the limit must not need it."""
    (tmp_path / "sleeper_mod.py").write_text(SLEEPER)
    spec = LaunchSpec(module="sleeper_mod", nproc_per_node=2, log_dir="logs", timeout_s=8, kill_after_s=5,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": ".", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"})
    script = torchrun.write_scripts(spec, tmp_path, "sleeper")[0]
    ranks: list[psutil.Process] = []

    def watch(line):
        if " PID " in line:
            ranks.append(psutil.Process(int(line.rsplit(" ", 1)[1])))

    try:
        result = process.run([shutil.which("bash"), str(script)], timeout_s=60, cwd=tmp_path, echo=watch,
                             check=False, env={"PYTHON": sys.executable, "PATH": path_without_timeout(tmp_path)})
        assert result.returncode == 124 and not result.timed_out  # the script's limit, not the runner's
        assert len(ranks) == 2
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for p in ranks:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
