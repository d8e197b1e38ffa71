"""Generated-file writers never leave the folder they were pointed at: a symbolic link inside it is refused
(file or folder, nothing written or chmod-ed through it), files are replaced atomically (no temporary file
left, the old file intact when a write fails), and `check` names exactly the extra files to delete."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.launch import catalog, generated
from distlab.launch.generated import GeneratedWriteError, check_dir, regenerate, write_file
from distlab.launch.sbatch import SlurmSpec, write_files

FILES = {"run.sh": "#!/bin/bash\necho run\n", "two/node0.sh": "#!/bin/bash\necho 0\n", "README.md": "notes\n"}


def _outside(tmp_path: Path) -> Path:
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("the user's own file\n")
    victim.chmod(0o600)
    return victim


def _unchanged(victim: Path) -> None:
    assert victim.read_text() == "the user's own file\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_a_symlinked_file_inside_the_folder_is_refused_and_its_target_unchanged(tmp_path):
    victim = _outside(tmp_path)
    root = tmp_path / "launch"
    regenerate(root, FILES)
    (root / "run.sh").unlink()
    (root / "run.sh").symlink_to(victim)
    with pytest.raises(GeneratedWriteError) as err:
        regenerate(root, FILES)
    assert str(err.value).count("\n") == 0 and str(root / "run.sh") in str(err.value)
    _unchanged(victim)
    with pytest.raises(GeneratedWriteError):
        write_file(root / "run.sh", "#!/bin/bash\n", root=root)
    _unchanged(victim)


def test_a_symlinked_folder_inside_the_folder_is_refused_and_nothing_is_created_there(tmp_path):
    victim = _outside(tmp_path)
    root = tmp_path / "launch"
    root.mkdir()
    (root / "two").symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(GeneratedWriteError, match="two: a symbolic link"):
        regenerate(root, FILES)
    _unchanged(victim)
    assert not (root / "run.sh").exists(), "regenerate wrote part of the folder before refusing"


def test_the_command_refuses_with_one_line_and_exit_2(tmp_path):
    victim = _outside(tmp_path)
    root = tmp_path / "launch"
    generated.regenerate(root, catalog.launch_files())
    (root / "run_4gpu.sh").unlink()
    (root / "run_4gpu.sh").symlink_to(victim)
    proc = subprocess.run([sys.executable, "-m", "distlab.launch", "regenerate", "--dir", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m distlab.launch: error: {root / 'run_4gpu.sh'}: a symbolic link inside {root}; "
        "refusing to write through it (delete it and run again)"]
    _unchanged(victim)


def test_the_slurm_and_torchrun_writers_refuse_links_too(tmp_path):
    victim = _outside(tmp_path)
    job = tmp_path / "job"
    job.mkdir()
    (job / "run.sh").symlink_to(victim)
    with pytest.raises(GeneratedWriteError, match="run.sh: a symbolic link"):
        write_files(SlurmSpec("demo", script_dir=str(job)), "/")
    _unchanged(victim)
    (job / "run.sh").unlink()
    written = write_files(SlurmSpec("demo", script_dir=str(job)), "/")
    assert [p.name for p in written] == ["submit.sbatch", "run.sh"]
    # One mode rule for every writer: scripts executable, the batch file (read by sbatch) not.
    assert [stat.S_IMODE(p.stat().st_mode) for p in written] == [0o644, 0o755]


def test_writes_are_atomic_and_leave_no_temporary_file(tmp_path):
    root = tmp_path / "launch"
    regenerate(root, FILES)
    inode = (root / "run.sh").stat().st_ino
    regenerate(root, {**FILES, "run.sh": "#!/bin/bash\necho new\n"})
    assert (root / "run.sh").stat().st_ino != inode, "the file was rewritten in place, not renamed over"
    every = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())
    assert every == sorted(FILES), "a temporary file was left behind"
    assert [stat.S_IMODE((root / r).stat().st_mode) for r in sorted(FILES)] == [0o644, 0o755, 0o755]
    # A write that fails half-way (text that cannot be encoded) keeps the old file and leaves nothing.
    with pytest.raises(UnicodeEncodeError):
        write_file(root / "run.sh", "#!/bin/bash\necho \udcff\n", root=root)
    assert (root / "run.sh").read_text() == "#!/bin/bash\necho new\n"
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "run.sh", "two"]


def test_paths_that_leave_the_folder_are_refused(tmp_path):
    with pytest.raises(GeneratedWriteError, match="a plain path inside"):
        regenerate(tmp_path / "launch", {"../escaped.sh": "x\n"})
    with pytest.raises(GeneratedWriteError, match="outside the folder"):
        write_file(tmp_path / "elsewhere.sh", "x\n", root=tmp_path / "launch")
    assert not (tmp_path / "escaped.sh").exists() and not (tmp_path / "elsewhere.sh").exists()


def test_check_names_exactly_the_extra_files_to_delete(tmp_path, capsys):
    root = tmp_path / "launch"
    files = catalog.launch_files()
    regenerate(root, files)
    (root / "old_run.sh").write_text(f"# {generated.GENERATED_MARK}\n")
    (root / "notes it's mine.txt").write_text("mine\n")
    (root / "k8s" / "link.yaml").symlink_to(tmp_path)
    capsys.readouterr()
    assert catalog.main(["check", "--dir", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "  old_run.sh: not produced by the generator (stale generated file: delete it, or regenerate)" in out
    assert ("  notes it's mine.txt: not produced by the generator (hand-written? delete it, or move it out: "
            "regenerate keeps it)") in out
    assert ("  k8s/link.yaml: not produced by the generator (a symbolic link: delete it, the generator writes "
            "only plain files)") in out
    rm = next(line for line in out if line.startswith("Extra files (3), to delete: "))
    command = rm.split(": ", 1)[1]
    assert shlex.split(command)[2:] == [str(root / p) for p in ("k8s/link.yaml", "notes it's mine.txt", "old_run.sh")]
    # Exactly those: running the printed command makes the folder pass.
    subprocess.run(["bash", "-c", command], check=True)
    assert check_dir(root, files) == [] and tmp_path.is_dir()
    assert catalog.main(["check", "--dir", str(root)]) == 0
    assert os.listdir(tmp_path)  # the link's target (this very folder) was not deleted through it
