"""Inference that survives a lost stage (distlab.inference.resume): the completion log keeps whole lines
only (a torn last line is dropped, named in one line and cut off; a broken line elsewhere or an id twice
is refused), a resumed run skips exactly the answered micro-batches and refuses other settings, and the
resumable Slurm job script. The real kills (under torchrun, and as a Slurm job on a one-machine cluster):
tests/clusters/test_inference_resume_runs.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from distlab import faults
from distlab.inference import outputs, resume
from distlab.inference.run import main as run_inference
from distlab.launch.sbatch import SlurmSpec, render_files


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
