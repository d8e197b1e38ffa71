"""Every chapter's quick profile, run as a workshop attendee runs it (`make test-attendee`).

An attendee's laptop is not the build machine: a normal user, a few cores, and none of its extras. So each
chapter runs here
- as a normal user (as root: the system user ATTENDEE_USER, created when missing),
- pinned to one core (`taskset`), so every `auto` parameter sees a one-core machine,
- with a PATH that lacks GNU `timeout`, `ip` and `tc`, Slurm and munge, and the C++ compilers,
- with its own HOME and build folder (the tiny model and DeepSpeed's op copied in, as `make env` leaves them
  on a reader's machine), so nothing is written into the repository.

Every chapter must run to its end; the lines the chapters printed for what they skipped or did not assert are
listed at the end. With two or more cores the chapters run in two lanes, each pinned to a core of its own
(a chapter that reads another's output runs after it in the same lane), which halves the wall time and still
gives every chapter one core.

    python -m distlab.publish.attendee [--only 00 05] [--work DIR] [--lanes 1|2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from distlab import paths
from distlab.cli import run_main
from distlab.jsonio import strict_json
from distlab.launch.process import run
from distlab.strategies.deepspeed_runtime import extensions_dir

USER = os.environ.get("ATTENDEE_USER", "distlab-attendee")
HIDDEN_TOOLS = {"timeout", "gtimeout", "ip", "tc", "sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo",
                "scancel", "slurmctld", "slurmd", "munged", "c++", "g++", "gcc", "cc", "clang", "clang++",
                "x86_64-linux-gnu-g++", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "aarch64-linux-gnu-gcc"}
# Two lanes of about equal length on two cores (about 26 minutes each here: 1,564 and 1,523 s of the chapters'
# times as an attendee on 72037d8). A chapter runs after the one whose output it reads (02 reads 00's measured
# limits, 06 reads 01's adapter), and 05 and 08 share a lane: both start the emulated LAN, whose names and
# rendezvous port (host_runs.PORT) one machine has once. 07 (tensor parallelism, no LAN) balances the lanes.
LANES = (["00", "02", "05", "08", "07"], ["01", "03", "04", "06"])
CHAPTER_TIMEOUT_S = 1800
SKIP_MARKS = ("skipped:", "not checked:", "not asserted")


def reduced_path(folder: Path, path: str | None = None) -> Path:
    """A folder of symlinks to every tool on `path` (default: this process's PATH) except HIDDEN_TOOLS (the
    first of a name wins)."""
    path = os.environ.get("PATH", "") if path is None else path
    folder.mkdir(parents=True, exist_ok=True)
    for directory in path.split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for tool in sorted(Path(directory).iterdir()):
            link = folder / tool.name
            if tool.name in HIDDEN_TOOLS or link.exists() or tool.is_dir() or not os.access(tool, os.X_OK):
                continue
            link.symlink_to(tool)
    return folder


def prepare(work: Path) -> dict[str, str]:
    """The attendee's folders and environment: HOME, build/ with the tiny model, DeepSpeed's op, PATH."""
    for name in ("home", "build", "figures", "notebooks"):
        (work / name).mkdir(parents=True, exist_ok=True)
    if paths.MODEL_CACHE.is_dir():  # built once per machine by `make models`
        shutil.copytree(paths.MODEL_CACHE, work / "build" / "models", dirs_exist_ok=True)
    ops = extensions_dir()
    if ops.is_dir():  # built by `make env` where a compiler was there: the chapters themselves compile nothing
        shutil.copytree(ops, work / "torch_extensions", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("lock"))
    return {"HOME": str(work / "home"), "PATH": str(reduced_path(work / "bin")), "LANG": "C.UTF-8",
            "DISTLAB_BUILD": str(work / "build"), "DISTLAB_TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
            # a reader owns their clone; this user does not, and git would refuse to name the commit
            "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": str(paths.REPO_ROOT)}


def as_attendee(work: Path) -> list[str]:
    """The command prefix that drops root: a system user of our own, owning the work folder."""
    if os.geteuid() != 0:
        return []
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    subprocess.run(["chown", "-R", USER, str(work)], check=True)
    return ["runuser", "-u", USER, "--"]


def open_the_way(work: Path) -> dict[Path, int]:
    """As root: let the attendee pass through (o+x) the folders above the checkout, the interpreter (a pyenv
    Python under /root, mode 700, is common) and the work folder, as a reader who owns all three can.
    Returns the folders changed with their old modes, for `close_the_way`."""
    if os.geteuid() != 0:
        return {}
    targets = [paths.REPO_ROOT, Path(sys.executable).resolve(), work]
    changed = {}
    for folder in blocked_folders(USER, targets):
        print(f"attendee run: {folder} is closed to other users: opening it for passing through (o+x) until the end")
        changed[folder] = folder.stat().st_mode
        folder.chmod(changed[folder] | 0o001)
    return changed


def close_the_way(changed: dict[Path, int]) -> None:
    for folder, mode in changed.items():
        folder.chmod(mode)


def blocked_folders(user: str, targets: list[Path]) -> list[Path]:
    """The folders on the way to `targets` that `user` may not pass through (mode without o+x, not theirs)."""
    blocked = []
    for target in targets:
        for folder in reversed(Path(target).resolve().parents):
            ok = subprocess.run(["runuser", "-u", user, "--", "test", "-x", str(folder)], capture_output=True)
            if ok.returncode != 0 and folder not in blocked:
                blocked.append(folder)
    return blocked


def lane_command(prefix: list[str], env: dict[str, str], work: Path, core: int, chapters: list[str],
                 lane: int) -> list[str]:
    return [*prefix, "env", "-i", *(f"{k}={v}" for k, v in env.items()), "taskset", "-c", str(core),
            sys.executable, "-m", "distlab.publish.regenerate", "--profile", "quick", "--force", "--only", *chapters,
            "--figures-dir", str(work / "figures"), "--out-dir", str(work / "notebooks"),
            "--work-dir", str(work / f"lane{lane}"), "--cache-dir", str(work / f"cache{lane}"),
            "--timeout-s", str(CHAPTER_TIMEOUT_S)]


def split_lanes(only: list[str] | None, lanes: int) -> list[list[str]]:
    chapters = [c for lane in LANES for c in lane]
    wanted = [c for c in chapters if only is None or c in only]
    if lanes == 1:
        return [sorted(wanted)]
    return [[c for c in lane if c in wanted] for lane in LANES if any(c in wanted for c in lane)]


def merge_summaries(work: Path, lanes: int) -> dict:
    """One summary.json for the book build, from each lane's."""
    merged: dict = {}
    for lane in range(lanes):
        path = work / f"lane{lane}" / "summary.json"
        if not path.is_file():
            continue
        summary = json.loads(path.read_text())
        notebooks = merged.get("notebooks", []) + summary["notebooks"]
        merged = {**summary, **merged, "notebooks": sorted(notebooks, key=lambda n: n["name"])}
        merged["ok"] = all(n["status"] == "ok" for n in merged["notebooks"])
    (work / "summary.json").write_text(strict_json(merged, indent=1))
    return merged


def skipped_lines(notebooks: Path) -> list[str]:
    """What the executed chapters printed about sections skipped and claims not asserted on this machine."""
    lines = []
    for nb in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(nb.read_text()).get("cells", []):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    lines += [f"{nb.stem[:2]}: {line}" for line in "".join(out.get("text", "")).splitlines()
                              if any(mark in line for mark in SKIP_MARKS)]
    return lines


def attend(work: Path, only: list[str] | None = None, lanes: int | None = None) -> dict:
    """Run the chapters as an attendee into `work`; returns the merged summary (ok: every chapter ran)."""
    cores = sorted(os.sched_getaffinity(0))  # Linux: taskset and runuser are too
    lanes = lanes or (2 if len(cores) >= 2 else 1)
    env = prepare(work)
    prefix = as_attendee(work)  # the user exists and owns the work folder before its lanes start
    plan = split_lanes(only, lanes)
    results: list = [None] * len(plan)

    def lane(i: int) -> None:
        cmd = lane_command(prefix, env, work, cores[i % len(cores)], plan[i], i)
        results[i] = run(cmd, timeout_s=CHAPTER_TIMEOUT_S * len(plan[i]), log_path=work / f"lane{i}.log",
                         echo=lambda line, i=i: print(f"[lane {i}] {line}", flush=True), check=False)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(plan))]
    changed = open_the_way(work)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        close_the_way(changed)
    summary = merge_summaries(work, len(plan))
    summary["ok"] = bool(summary.get("ok")) and all(r is not None and r.returncode == 0 for r in results)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.publish.attendee", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NN", help="these chapters only (numbers)")
    ap.add_argument("--work", type=Path, help="the attendee's folder (default: a new one under /tmp)")
    ap.add_argument("--lanes", type=int, choices=(1, 2), help="chapters side by side, one core each (default: 2 "
                                                               "with 2 or more cores)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="distlab-attendee-"))
    summary = attend(work, args.only, args.lanes)
    print("\nchapters as an attendee (one core each, normal user, no timeout/ip/tc/Slurm/compiler on PATH):")
    for nb in summary.get("notebooks", []):
        print(f"  {nb['name']}: {nb['status']} in {nb['elapsed_s']:.0f} s"
              + (f" (cell {nb['failing_cell']}: {nb['message']})" if nb["status"] != "ok" else ""))
    lines = skipped_lines(work / "notebooks")
    print(f"sections skipped or claims not asserted there ({len(lines)}):")
    print("\n".join(f"  {line}" for line in lines) or "  none")
    print(f"outputs in {work}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    run_main(main)
