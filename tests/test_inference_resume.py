"""Inference that survives a lost stage (distlab.inference.resume): the completion log keeps whole lines
only (a torn last line is dropped, named in one line and cut off; a broken line elsewhere or an id twice
is refused), a resumed run skips exactly the answered micro-batches and refuses other settings; then
for real, a 2-stage pipeline whose last stage is SIGKILLed after N micro-batches: under torchrun, and
as a resumable Slurm job (--requeue, logs appended, a stable output folder) on a one-machine cluster,
finished by `scontrol requeue` and then submitted again: answers token-identical to an uninterrupted
run, every prompt answered once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlab import faults
from distlab.inference import outputs, resume
from distlab.inference.run import main as run_inference
from distlab.launch import process
from distlab.launch.sbatch import SlurmSpec, render_files, write_files
from distlab.paths import DEMO_PROMPTS

HAVE_SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch", "sacct", "scontrol"))
SLURM_CTLD_PORT = 28817  # the `cluster` fixture's ports (conftest): 28817-28819, this module's own
# 8 demo prompts in 4 micro-batches of 2, two in flight: the last stage writes micro-batches 0 and 1, then dies
ARGS = ["--max-new-tokens", "6", "--batch-size", "2", "--in-flight", "2"]
KILL_AFTER = 2
KILL = {"DISTLAB_KILL_AFTER_MICRO_BATCHES": str(KILL_AFTER), "DISTLAB_KILL_RANK": "1"}


def rows(*ids):
    return [{"id": i, "tokens": [1, 2]} for i in ids]


def test_a_torn_last_line_is_dropped_named_and_cut_off(tmp_path):
    log = tmp_path / resume.COMPLETIONS
    resume.append_rows(log, rows("a", "b"))
    with open(log, "ab") as f:
        f.write(b'{"id": "c", "tok')  # the write a SIGKILL cut
    state = resume.read_log(log)
    assert [r["id"] for r in state.rows] == ["a", "b"] and state.dropped == b'{"id": "c", "tok'
    note = state.dropped_note(log)
    assert "\n" not in note and "truncated last line (16 bytes" in note and str(log) in note
    resume.repair(log, state)
    resume.append_rows(log, rows("c"))
    assert [r["id"] for r in resume.read_log(log).rows] == ["a", "b", "c"]
    assert resume.read_log(log).dropped_note(log) is None


def test_a_file_without_a_complete_line_has_no_completion(tmp_path):
    log = tmp_path / resume.COMPLETIONS
    log.write_bytes(b'{"id": "a"')
    state = resume.read_log(log)
    assert state.rows == [] and state.valid_bytes == 0 and state.dropped
    assert resume.read_log(tmp_path / "missing.jsonl").rows == []


@pytest.mark.parametrize("content,message", [
    (b'{"id": "a"}\n{"id": \n{"id": "b"}\n', ":2: not a completion row"),
    (b'{"id": "a"}\n{"id": "a"}\n', ":2: prompt 'a' answered twice"),
    (b'{"id": "a"}\n[1, 2]\n', ":2: not a completion row"),
])
def test_a_broken_complete_line_or_a_repeated_id_is_refused(tmp_path, content, message):
    log = tmp_path / resume.COMPLETIONS
    log.write_bytes(content)
    with pytest.raises(resume.CompletionLogError, match=message):
        resume.read_log(log)


def test_resuming_refuses_other_settings_and_a_fresh_run_starts_empty(tmp_path):
    settings = {"model": "m", "batch_size": 2, "max_new_tokens": 6}
    resume.start(tmp_path, settings, resume=False)
    resume.append_rows(tmp_path / resume.COMPLETIONS, rows("a"))
    state, note = resume.start(tmp_path, settings, resume=True)
    assert state.ids == {"a"} and note is None
    with pytest.raises(resume.CompletionLogError, match=r"\(batch_size, max_new_tokens differ\)"):
        resume.start(tmp_path, {**settings, "batch_size": 4, "max_new_tokens": 8}, resume=True)
    (tmp_path / resume.SETTINGS).unlink()
    with pytest.raises(resume.CompletionLogError, match="no run_settings.json"):
        resume.start(tmp_path, settings, resume=True)
    state, _ = resume.start(tmp_path, settings, resume=False)
    assert state.ids == set() and not (tmp_path / resume.COMPLETIONS).exists()


def test_only_fully_answered_micro_batches_are_skipped():
    class MB:
        def __init__(self, index, ids):
            self.index, self.ids = index, ids

    batches = [MB(0, ["a", "b"]), MB(1, ["c", "d"]), MB(2, ["e", "f"])]
    # c's line was torn: micro-batch 1 runs again as it was (same rows, same index), only c is appended
    assert [mb.index for mb in resume.remaining(batches, {"a", "b", "d"})] == [1, 2]
    assert resume.remaining(batches, {"a", "b", "c", "d", "e", "f"}) == []


def test_token_mismatches_name_a_changed_or_missing_answer():
    ref = rows("a", "b", "c")
    assert outputs.token_mismatches(rows("c", "b", "a"), ref) == []  # order does not matter
    assert outputs.token_mismatches([{"id": "a", "tokens": [1, 3]}, *rows("b")], ref) == ["a", "c"]


def test_a_restarted_or_requeued_attempt_is_not_killed_again(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert faults.first_attempt()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert not faults.first_attempt()
    monkeypatch.setenv("DISTLAB_KILL_AFTER_MICRO_BATCHES", "2")
    faults.after_micro_batches(2, 1)  # requeued: armed, but not on this attempt (a kill would end pytest)


def test_a_prompt_file_with_an_id_twice_is_refused_before_any_work(tmp_path):
    line = json.dumps({"id": "same", "prompt": "Hello?"})
    (tmp_path / "p.jsonl").write_text(f"{line}\n{line}\n")
    with pytest.raises(ValueError, match="prompt id 'same' appears more than once"):
        run_inference(["--model", str(tmp_path / "no-model"), "--prompts", str(tmp_path / "p.jsonl"), "--out-dir",
                       str(tmp_path / "out"), "--threads", str(torch.get_num_threads())])
    assert not (tmp_path / "out" / resume.COMPLETIONS).exists()


def test_a_resumable_job_script(tmp_path):
    spec = SlurmSpec("rs", args=["--batch-size", "2"], out_dir="build/runs/o", resumable=True)
    files = render_files(spec)
    sb, run = files["submit.sbatch"], files["run.sh"]
    assert "#SBATCH --requeue\n#SBATCH --open-mode=append\n" in sb
    assert "srun --kill-on-bad-exit=1 --open-mode=append --output=" in sb
    assert "OUT_DIR=build/runs/o/rs\n" in run and "SLURM_JOB_ID" not in run.split("OUT_DIR=")[1].split("\n")[0]
    assert " --resume --out-dir " in run
    plain = render_files(SlurmSpec("rs", args=["--batch-size", "2"], out_dir="build/runs/o"))
    assert "requeue" not in plain["submit.sbatch"] and "--resume" not in plain["run.sh"]
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
        subprocess.run(["bash", "-n", str(tmp_path / rel)], check=True)
        if shutil.which("shellcheck"):
            out = subprocess.run(["shellcheck", "-s", "bash", str(tmp_path / rel)], capture_output=True, text=True)
            assert out.returncode == 0, out.stdout
    with pytest.raises(ValueError, match="SlurmSpec.resumable: "):
        SlurmSpec("rs", resumable="yes")


# ---------------------------------------------------------------------- a real pipeline, a real kill


@pytest.fixture(scope="module")
def model_dir():
    from distlab.inference.stage_weights import random_checkpoint  # deferred: writes a checkpoint (transformers)

    return random_checkpoint("test-tiny")


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """One stage in this process, never interrupted: the answers every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    threads = str(torch.get_num_threads())  # main() sets the count for the whole process: keep pytest's
    assert run_inference(["--model", str(model_dir), *ARGS, "--threads", threads, "--out-dir", str(out)]) == 0
    got = outputs.completions(out)
    assert len(got) == len(DEMO_PROMPTS.read_text().splitlines()) == 8
    return got


def check_finished(out: Path, reference: list[dict]) -> dict:
    """The whole prompt list answered once each, token for token as the uninterrupted run."""
    ids = [json.loads(line)["id"] for line in (out / resume.COMPLETIONS).read_text().splitlines()]
    assert len(ids) == len(set(ids)) == len(reference), f"answered twice or missing: {ids}"
    assert outputs.token_mismatches(outputs.completions(out), reference) == []
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_torchrun_stage_killed_then_resumed(model_dir, uninterrupted, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "distlab.inference", "--model", str(model_dir), *ARGS, "--out-dir", str(tmp_path), "--resume"]
    lost = process.run(cmd, timeout_s=120, env=KILL, log_path=tmp_path / "lost.log", echo=False, check=False)
    # torchrun names rank 1 as killed by SIGKILL (then stops rank 0 with SIGTERM: -15, when it is still running)
    assert not lost.ok and lost.failed_ranks.get(1) == -9, lost.tail[-20:]
    assert "rank 1: SIGKILL after 2 finished micro-batches" in (tmp_path / "lost.log").read_text()
    kept = outputs.completions(tmp_path)
    assert [r["micro_batch"] for r in kept] == [0, 0, 1, 1] and not (tmp_path / "summary.json").exists()
    with open(tmp_path / resume.COMPLETIONS, "ab") as f:
        f.write(json.dumps(uninterrupted[-1]).encode()[:25])  # as if the crash had cut a write in half
    again = process.run(cmd, timeout_s=120, log_path=tmp_path / "again.log", echo=False)
    assert again.ok
    log = (tmp_path / "again.log").read_text()
    assert log.count("dropped a truncated last line (25 bytes") == 1
    assert "resuming: 4 of 8 prompts already answered, 2 of 4 micro-batches left" in log
    summary = check_finished(tmp_path, uninterrupted)
    assert (summary["answered_before"], summary["answered_now"], summary["micro_batches_run"]) == (4, 4, 2)
    rank1 = (tmp_path / "rank1.log").read_text()  # --resume appends: the killed attempt's lines stay above
    assert rank1.count("generating:") == 2 and rank1.index("generating: 8") < rank1.index("resuming: 4 of 8")


def job_story(cluster, job_id: int, logs: Path) -> str:
    """What a failed attempt left: every completion record of the job and the tail of each of its logs."""
    from distlab.slurm import submit  # deferred: only with Slurm installed

    parts = [f"records: {submit.sacct(cluster, [job_id])}"]
    parts += [f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(logs.glob(f"*-{job_id}*"))]
    daemon_log = cluster.root / "log" / "slurmctld.log"
    parts.append(f"--- slurmctld.log\n{daemon_log.read_text()[-3000:] if daemon_log.exists() else '(none)'}")
    return "\n".join(parts)


needs_slurm = pytest.mark.skipif(not HAVE_SLURM, reason="slurm-wlm and munge are not installed "
                                 "(tools/ensure_debian_packages.sh installs them)")


@needs_slurm
@pytest.mark.slow
def test_slurm_job_loses_a_stage_then_requeue_and_sbatch_finish_it(cluster, model_dir, uninterrupted, tmp_path):
    from distlab.slurm import submit  # deferred: only with Slurm installed

    spec = SlurmSpec("rs", args=ARGS, model_dir=str(model_dir), out_dir=str(tmp_path / "out"),
                     log_dir=str(tmp_path / "logs"), time="00:02:00", script_dir=str(tmp_path / "job"),
                     resumable=True)
    write_files(spec, "/")
    (tmp_path / "logs").mkdir()
    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHON": sys.executable}
    job_id = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env={**env, **KILL}, cwd=repo)
    rec = submit.wait(cluster, job_id, timeout_s=120)
    out, job_log = tmp_path / "out" / "rs", tmp_path / "logs" / f"rs-{job_id}.out"
    assert rec["State"] == "FAILED", job_story(cluster, job_id, tmp_path / "logs")
    assert "task 1: Killed" in job_log.read_text()
    rank1_log = tmp_path / "logs" / f"rs-{job_id}-rank1.log"
    assert "rank 1: SIGKILL after 2 finished micro-batches" in rank1_log.read_text()
    assert len(outputs.completions(out)) == KILL_AFTER * 2 and not (out / "summary.json").exists()

    rec = submit.requeue(cluster, job_id, timeout_s=120)  # same job id; SLURM_RESTART_COUNT=1 disarms the kill
    assert rec["State"] == "COMPLETED", job_story(cluster, job_id, tmp_path / "logs")
    summary = check_finished(out, uninterrupted)
    assert (summary["answered_before"], summary["answered_now"], summary["slurm_restart_count"]) == (4, 4, 1)
    # --open-mode=append: the lost attempt's lines are still above the requeued one's
    assert "task 1: Killed" in job_log.read_text() and job_log.read_text().count(f"job {job_id}:") == 2
    rank1 = rank1_log.read_text()
    assert rank1.index("SIGKILL after 2") < rank1.index("resuming: 4 of 8")

    again_id = submit.submit(cluster, tmp_path / "job" / "submit.sbatch", env=env, cwd=repo)
    rec = submit.wait(cluster, again_id, timeout_s=120)
    assert rec["State"] == "COMPLETED" and again_id != job_id, rec
    summary = check_finished(out, uninterrupted)  # idempotent: nothing left, nothing answered twice
    assert (summary["answered_before"], summary["answered_now"], summary["micro_batches_run"]) == (8, 0, 0)
    assert submit.queue(cluster) == [] and os.environ.get("DISTLAB_KILL_AFTER_MICRO_BATCHES") is None
