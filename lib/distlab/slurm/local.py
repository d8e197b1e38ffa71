"""A Slurm job's tasks run on this machine without Slurm: the same `run.sh`, once per task, as `srun` would
start it, where no cluster can be started (a laptop as a normal user, macOS) or none is wanted.

`run_spec(spec, timeout_s)` is `submit.run_spec` without a cluster: it writes the spec's `submit.sbatch` and
`run.sh` (the lesson still shows them), then runs `run.sh` once per task with what srun and `submit.sbatch`
would give it: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (every task is on this one machine),
SLURM_CPUS_PER_TASK, SLURM_JOB_ID, SLURM_JOB_NAME, and MASTER_ADDR=127.0.0.1 with a free port (not the
job-id port of `submit.sbatch`: other programs on a laptop may hold it). Each task's output goes to the file
srun would write (`<log_dir>/<name>-<id>-rank<t>.log`), the job's own to `<log_dir>/<name>-<id>.out`.

The tasks run under `distlab.launch.process.run`: one process group, the job's time limit (or the caller's
timeout, the smaller) as a hard timeout, killed as a group at the end. `python -m distlab.slurm.local` is the
process that starts them inside that group: when a task fails it names it as srun does ("task 1: Killed")
and stops the others at once, as `srun --kill-on-bad-exit=1` does. Job ids count on from the largest id
found in the job's output and log folders, so a local job never reuses a finished job's folder.

Every job returns a record shaped like the one `sacct -c` gives (JobID, JobName, Partition, NNodes, NCPUS,
NodeList, State, ExitCode, Elapsed, Timelimit, ElapsedRaw, CPUTimeRaw); `records_table` prints them as
`sacct -c` prints its table. The job runs on one node, whatever `spec.nodes` asks for.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from distlab.cli import run_main
from distlab.launch import process
from distlab.paths import REPO_ROOT
from distlab.slurm.submit import elapsed_s

PARTITION = "local"
TABLE_FIELDS = ("JobID", "JobName", "Partition", "NNodes", "NCPUS", "NodeList", "State", "ExitCode", "Elapsed",
                "Timelimit")
POLL_S = 0.05  # how often the task starter looks at its tasks


def next_job_id(*folders: Path) -> int:
    """One more than the largest job id in the folders: numeric folder names (a job's outputs) and the
    `<name>-<id>.out` / `<name>-<id>-rank<t>.log` log names."""
    found = [0]
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            m = re.fullmatch(r"\d+", p.name) if p.is_dir() else re.search(r"-(\d+)(?:-rank\d+\.log|\.out)$", p.name)
            if m:
                found.append(int(m.group(1) if m.groups() else m.group(0)))
    return max(found) + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run_spec(spec, timeout_s: float, env: dict | None = None, root: str | Path | None = None) -> tuple[int, dict]:
    """Write a SlurmSpec's scripts under `root` (the repository), run its run.sh once per task on this machine,
    wait for the end; returns (job id, record), as `submit.run_spec` does on a cluster."""
    from distlab.launch.sbatch import write_files  # deferred: distlab.launch loads the strategies

    root = Path(root or REPO_ROOT)
    write_files(spec, root)
    log_dir = root / spec.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    job_id = next_job_id(root / spec.out_dir, log_dir)
    tasks, limit_s = spec.world_size, min(timeout_s, elapsed_s(spec.time))
    job_env = {**(env or {}), "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": spec.name, "SLURM_NTASKS": str(tasks),
               "SLURM_CPUS_PER_TASK": str(spec.cpus_per_task), "SLURM_SUBMIT_DIR": str(root),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "distlab.slurm.local", "--ntasks", str(tasks),
           "--output", str(log_dir / f"{spec.name}-{job_id}-rank%t.log"), str(root / spec.script_dir / "run.sh")]
    result = process.run(cmd, timeout_s=limit_s, log_path=log_dir / f"{spec.name}-{job_id}.out", env=job_env,
                         cwd=root, echo=False, check=False)
    code = result.returncode if result.returncode is not None else -signal.SIGKILL
    state = "TIMEOUT" if result.timed_out else "COMPLETED" if code == 0 else "FAILED"
    elapsed = int(round(result.elapsed_s))
    record = {"JobID": str(job_id), "JobName": spec.name, "Partition": PARTITION, "NNodes": "1",
              "NCPUS": str(tasks * spec.cpus_per_task), "NodeList": socket.gethostname(), "State": state,
              "ExitCode": f"{code}:0" if code >= 0 else f"0:{-code}", "Elapsed": hms(elapsed),
              "Timelimit": spec.time, "ElapsedRaw": elapsed, "CPUTimeRaw": elapsed * tasks * spec.cpus_per_task}
    return job_id, record


def records_table(records) -> str:
    """The records as `sacct -c` prints its table: a header, a dashed rule, one line per job."""
    rows = [[str(r.get(f, "")) for f in TABLE_FIELDS] for r in records]
    widths = [max([len(f), *(len(row[i]) for row in rows)]) for i, f in enumerate(TABLE_FIELDS)]
    lines = [TABLE_FIELDS, ["-" * w for w in widths], *rows]
    return "\n".join(" ".join(c.rjust(w) if c.isdigit() else c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in lines)


def failure(code: int) -> str:
    """How srun names a task's end: "Killed" (SIGKILL), "Killed by signal N", "Exited with exit code N"."""
    if code == -signal.SIGKILL:
        return "Killed"
    return f"Killed by signal {-code}" if code < 0 else f"Exited with exit code {code}"


def start_tasks(script: str, ntasks: int, output: str) -> int:
    """Start `bash script` once per task (SLURM_PROCID, SLURM_LOCALID = the task), each writing to `output`
    with %t replaced by the task; wait for all of them. The first task that fails is named ("task 1: Killed")
    and the others are stopped; returns its exit status (128 + signal for a signal), else 0."""
    procs = []
    for t in range(ntasks):
        with open(output.replace("%t", str(t)), "w", encoding="utf-8") as log:
            procs.append(subprocess.Popen(["bash", script], stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL,
                                          env={**os.environ, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t)}))
    print(f"job {os.environ.get('SLURM_JOB_ID', '?')}: {ntasks} tasks on {socket.gethostname()} (no Slurm: "
          f"distlab.slurm.local), master {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}", flush=True)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(t, c) for t, c in enumerate(codes) if c]
        if failed or all(c is not None for c in codes):
            break
        time.sleep(POLL_S)
    if not failed:
        return 0
    for t, code in failed:
        print(f"distlab.slurm.local: error: task {t}: {failure(code)}", flush=True)
    if any(c is None for c in codes):
        print("distlab.slurm.local: stopping the other tasks (as srun --kill-on-bad-exit=1 does)", flush=True)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        p.wait()
    code = failed[0][1]
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.slurm.local",
                                 description="Start a job's run.sh once per task, as srun would (run_spec calls it).")
    ap.add_argument("--ntasks", type=int, required=True)
    ap.add_argument("--output", required=True, help="each task's log; %%t is the task number")
    ap.add_argument("script", help="the job's run.sh")
    args = ap.parse_args(argv)
    if args.ntasks < 1:
        ap.error(f"--ntasks {args.ntasks}: need at least 1")
    if not Path(args.script).is_file():
        ap.error(f"{args.script}: no such job script")
    return start_tasks(args.script, args.ntasks, args.output)


if __name__ == "__main__":
    run_main(main)
