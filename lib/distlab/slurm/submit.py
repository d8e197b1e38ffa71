"""Jobs on the cluster: submit with sbatch, wait for the end under a deadline, requeue a finished job (the
same job id runs again), read the completion records back with `sacct -c` (jobcomp/filetxt: elapsed
time, CPUs, state, exit code; a requeued job has one record per attempt, the last one counts)."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

from distlab.paths import REPO_ROOT
from distlab.slurm.cluster import Cluster

SACCT_FIELDS = "JobID,JobName%16,Partition,NNodes,NCPUS,NodeList,State,ExitCode,Elapsed,Timelimit"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


REQUEUE_DELAY_S = 2  # a requeued attempt starts this long after `scontrol requeue` (see `requeue`)


class JobError(RuntimeError):
    pass


def _client(cluster: Cluster, cmd: list[str], timeout_s: float = 15, env: dict | None = None) -> str:
    out = subprocess.run(cmd, env={**cluster.client_env(), **(env or {})}, capture_output=True, text=True,
                         timeout=timeout_s, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise JobError(f"{' '.join(cmd)}: exit {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def submit(cluster: Cluster, script: str | Path, *extra: str, env: dict | None = None, cwd: str | Path | None = None,
           ) -> int:
    """sbatch the script (from `cwd`, the submit directory); returns the job id."""
    cmd = ["sbatch", "--parsable", *extra, str(script)]
    out = subprocess.run(cmd, env={**cluster.client_env(), **(env or {})}, capture_output=True, text=True,
                         timeout=15, cwd=cwd, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise JobError(f"sbatch {script}: {(out.stderr or out.stdout).strip()}")
    return int(out.stdout.strip().split(";")[0])


def queue(cluster: Cluster) -> list[str]:
    """Jobs still pending or running (squeue), one line each."""
    return [ln for ln in _client(cluster, ["squeue", "-h", "-o", "%i %j %T %M %R"]).splitlines() if ln.strip()]


def wait(cluster: Cluster, job_id: int, timeout_s: float, poll_s: float = 0.5) -> dict:
    """Block until the job has left the queue and its completion record exists; returns that record.
    Past the deadline the job is cancelled and JobError raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {r["JobID"]: r for r in sacct(cluster, [job_id])}
        rec = records.get(str(job_id))
        if rec and rec["State"].split()[0] in FINAL_STATES and not any(
                ln.split()[0] == str(job_id) for ln in queue(cluster)):
            return rec
        if time.monotonic() > deadline:
            _client(cluster, ["scancel", str(job_id)])
            raise JobError(f"job {job_id} still {rec['State'] if rec else 'queued'} after {timeout_s:.0f}s: cancelled")
        time.sleep(poll_s)


def requeue(cluster: Cluster, job_id: int, timeout_s: float) -> dict:
    """`scontrol requeue` a finished (or running) batch job of a --requeue script, wait for its next attempt
    to end; returns that attempt's record. Slurm holds a requeued job until its credentials have expired
    (AuthInfo cred_expire + 1 s, 121 s by default); its start time is moved up, as an administrator would,
    so the demo does not wait two minutes for nothing. Not to now: the nodes revoked the lost attempt's
    credential when it ended, and a credential created in that same second counts as revoked (Slurm compares
    whole seconds), so an attempt started at once can be refused ("Job credential revoked") and end FAILED.
    Two seconds on, the new credential is younger than the revocation."""
    before = len(sacct(cluster, [job_id]))
    _client(cluster, ["scontrol", "requeue", str(job_id)])
    _client(cluster, ["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{REQUEUE_DELAY_S}"])
    deadline = time.monotonic() + timeout_s
    while len(sacct(cluster, [job_id])) == before:  # the requeue's own record: the old one no longer counts
        if time.monotonic() > deadline:
            raise JobError(f"job {job_id}: no new record {timeout_s:.0f}s after scontrol requeue")
        time.sleep(0.2)
    return wait(cluster, job_id, max(1.0, deadline - time.monotonic()))


def sacct(cluster: Cluster, job_ids=None, fields: str = SACCT_FIELDS) -> list[dict]:
    """Completion records (sacct -c, parsable), with CPUTime = NCPUS x Elapsed in seconds added."""
    cmd = ["sacct", "-c", "-P", f"--format={fields}"] + ([f"--jobs={','.join(map(str, job_ids))}"] if job_ids else [])
    lines = _client(cluster, cmd).splitlines()
    if not lines:
        return []
    head = lines[0].split("|")
    rows = [dict(zip(head, ln.split("|"))) for ln in lines[1:] if ln.strip()]
    for r in rows:
        if "Elapsed" in r and "NCPUS" in r:
            r["ElapsedRaw"] = elapsed_s(r["Elapsed"])
            r["CPUTimeRaw"] = r["ElapsedRaw"] * int(r["NCPUS"] or 0)
    return rows


def sacct_table(cluster: Cluster, job_ids, fields: str = SACCT_FIELDS) -> str:
    """The records as Slurm prints them (sacct -c's own table)."""
    return _client(cluster, ["sacct", "-c", f"--format={fields}", f"--jobs={','.join(map(str, job_ids))}"])


def elapsed_s(text: str) -> int:
    """Slurm's [D-]HH:MM:SS (or MM:SS) as seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(timedelta(days=int(days or 0), hours=parts[0], minutes=parts[1], seconds=parts[2]).total_seconds())


def run_spec(cluster: Cluster, spec, timeout_s: float, env: dict | None = None, root: str | Path | None = None):
    """Write a SlurmSpec's scripts under `root` (the repository), submit them from there, wait for the end;
    returns (job id, completion record). The log folder is created first: Slurm opens --output itself."""
    from distlab.launch.sbatch import write_files  # deferred: distlab.launch loads the strategies

    root = Path(root or REPO_ROOT)
    write_files(spec, root)
    (root / spec.log_dir).mkdir(parents=True, exist_ok=True)
    job_id = submit(cluster, root / spec.script_dir / "submit.sbatch", env=env, cwd=root)
    return job_id, wait(cluster, job_id, timeout_s)
