"""A run resumes only its own checkpoint: the checkpoint records the fingerprint of the run that wrote it,
and a run with other settings (lr, max_steps, data, a checkpoint from before fingerprints) is refused
with one line naming what differs, before it touches the folder; resume=force continues and says so.
Sweeps refuse two variants naming one folder however spelled, and the run's JSON parses strictly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from distlab import checkpoint
from distlab.checkpoint import ResumeMismatch
from distlab.cli import run_main
from distlab.config import TrainConfig
from distlab.jsonio import strict_json
from distlab.metrics import read_log
from distlab.paths import TRAIN_FILE
from distlab.train import main, train, variant_configs

# 4 steps, a checkpoint after steps 2 and 3 (none at the last step): a resume trains step 4 again
RUN = dict(max_steps=4, checkpoint_steps=1, keep_checkpoints=2, seq_len=128, micro_batch_size=2, lr=1e-2,
           warmup_steps=1, logging_steps=1, num_threads=1, eval_file=None, save_model=False, progress=False,
           lora_dropout=0.0)


def _reject_constant(name):
    raise ValueError(f"not JSON: {name}")


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as every non-Python JSON reader does."""
    return json.loads(text, parse_constant=_reject_constant)


def losses(log):
    return {r["step"]: r["loss"] for r in read_log(log)}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 3; tests copy it before changing it."""
    out = tmp_path_factory.mktemp("resume") / "run"
    result = train(TrainConfig(**RUN, output_dir=str(out)))
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002", "step-00000003"]
    return out, losses(result.log_path)


@pytest.fixture
def run_dir(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    return out


def test_the_same_settings_resume_and_match_the_uninterrupted_run(finished, run_dir):
    result = train(TrainConfig(**RUN, output_dir=str(run_dir)))
    assert result.resumed_from == 3
    assert losses(result.log_path) == finished[1]  # steps 1-3 from the checkpoint's log, step 4 recomputed
    meta = strict_loads((run_dir / "run_metadata.json").read_text())
    assert "resumed_with_different_settings" not in meta and meta["fingerprint"]["lr"] == 1e-2
    saved = json.loads((checkpoint.latest(run_dir) / checkpoint.FINGERPRINT).read_text())
    assert saved == meta["fingerprint"]


def _refused(run_dir: Path, **changes) -> str:
    log_before = (run_dir / "train_log.jsonl").read_text()
    with pytest.raises(ResumeMismatch) as info:
        train(TrainConfig(**{**RUN, **changes}, output_dir=str(run_dir)))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{run_dir}: ")
    assert (run_dir / "train_log.jsonl").read_text() == log_before  # refused before anything was written
    return message


def test_a_different_lr_is_refused_naming_lr(run_dir):
    message = _refused(run_dir, lr=2e-2)
    assert "the checkpoint at step 3 was written by another run: lr 0.01 -> 0.02;" in message
    assert "--set resume=force" in message


def test_a_shorter_max_steps_is_refused(run_dir):
    assert "max_steps 4 -> 2" in _refused(run_dir, max_steps=2)


def test_another_data_file_is_refused_and_the_same_bytes_renamed_are_not(run_dir, tmp_path):
    rows = TRAIN_FILE.read_text().splitlines(keepends=True)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(rows[:-1]))
    message = _refused(run_dir, train_file=str(other))
    assert "train_data " in message and "max_steps" not in message
    renamed = tmp_path / "renamed.jsonl"
    shutil.copy(TRAIN_FILE, renamed)
    assert train(TrainConfig(**RUN, train_file=str(renamed), output_dir=str(run_dir))).resumed_from == 3


def test_settings_that_do_not_change_the_numbers_resume(run_dir):
    cfg = TrainConfig(**{**RUN, "logging_steps": 2, "keep_checkpoints": 3, "eval_at_start": False},
                      output_dir=str(run_dir))
    assert train(cfg).resumed_from == 3


def test_the_cli_refuses_with_one_line_and_exit_2(run_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("".join(f"{k}: {v if v is not None else 'null'}\n" for k, v in RUN.items())
                      + f"output_dir: {run_dir}\n")
    with pytest.raises(SystemExit) as info:
        run_main(main, ["--config", str(config), "--set", "lr=0.02", "--set", "warmup_steps=2"],
                 prog="python -m distlab.train")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("python -m distlab.train: error: ")
    assert "lr 0.01 -> 0.02, warmup_steps 1 -> 2;" in err


def test_force_continues_and_records_the_differing_fields(run_dir):
    result = train(TrainConfig(**{**RUN, "lr": 2e-2, "resume": "force"}, output_dir=str(run_dir)))
    assert result.resumed_from == 3
    meta = strict_loads((run_dir / "run_metadata.json").read_text())
    assert meta["resumed_with_different_settings"] == ["lr"] and meta["config"]["resume"] == "force"
    assert read_log(result.log_path, event="resume")[-1]["different_settings"] == ["lr"]


def test_force_cannot_resume_past_max_steps(run_dir):
    message = _refused(run_dir, max_steps=3, resume="force")
    assert "the checkpoint is at step 3 and the run has 3 steps: nothing left to train" in message


def test_force_cannot_cross_a_world_layout(run_dir):
    current = json.loads((checkpoint.latest(run_dir) / checkpoint.FINGERPRINT).read_text())
    with pytest.raises(ResumeMismatch, match="world_size 1, this run has world_size 2.*even with resume=force"):
        checkpoint.check_resume(checkpoint.latest(run_dir), {**current, "world_size": 2}, 4, force=True)


def test_a_checkpoint_without_fingerprint_is_refused_unless_forced(run_dir):
    for ckpt in checkpoint.complete_checkpoints(run_dir):
        (ckpt / checkpoint.FINGERPRINT).unlink()
    assert "the checkpoint at step 3 records no fingerprint" in _refused(run_dir)
    result = train(TrainConfig(**{**RUN, "resume": "force"}, output_dir=str(run_dir)))
    assert result.resumed_from == 3
    assert strict_loads((run_dir / "run_metadata.json").read_text())["resumed_with_different_settings"] == [
        "fingerprint"]


def test_resume_false_starts_over(run_dir):
    assert train(TrainConfig(**{**RUN, "lr": 2e-2, "resume": False}, output_dir=str(run_dir))).resumed_from == 0


def test_resume_accepts_true_false_and_force_only():
    assert [TrainConfig(resume=v).resume for v in ("force", "FORCE", "yes", False)] == ["force", "force", True, False]
    with pytest.raises(ValueError, match=r"resume='maybe' is not accepted: expected true, false or force"):
        TrainConfig(resume="maybe")


def test_two_variants_naming_one_folder_in_two_spellings_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 3\n")
    with pytest.raises(ValueError) as info:
        variant_configs(config, {}, ["{output_dir: build/runs/x}", "{output_dir: ./build/runs/../runs/x}"])
    message = str(info.value)
    assert "\n" not in message
    assert message == (f"--variant 2 and --variant 1 share output_dir {tmp_path / 'build/runs/x'} (spelled "
                       f"build/runs/x and ./build/runs/../runs/x): the second run would overwrite the first")
    assert len(variant_configs(config, {}, ["{output_dir: build/runs/x}", "{output_dir: build/runs/y}"])) == 2


def test_the_runs_json_is_strict_even_when_the_loss_is_not_finite():
    record = {"final_loss": float("nan"), "eval_loss_after": float("inf"), "losses": [1.0, -math.inf],
              "nested": {"x": (float("nan"), 2)}, "path": Path("a/b")}
    assert "NaN" in json.dumps(record, default=str)  # what json.dumps alone writes
    assert strict_loads(strict_json(record, indent=2)) == {"final_loss": None, "eval_loss_after": None,
                                                           "losses": [1.0, None], "nested": {"x": [None, 2]},
                                                           "path": "a/b"}


def test_epochs_decide_the_step_count_and_a_finished_epoch_run_has_nothing_left(tmp_path):
    """epochs=2 over 16 rows at 4 rows a step: 2 x 4 steps, the second epoch a fresh permutation; max_steps is
    not used (another value resumes as the same run). A run whose epochs end before its checkpoint is refused
    once the data is read and the steps are known: nothing is left to train."""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:16]))
    cfg = TrainConfig(**{**RUN, "max_steps": 3, "checkpoint_steps": 7, "micro_batch_size": 4}, epochs=2,
                      train_file=str(rows), output_dir=str(tmp_path / "run"))
    result = train(cfg)
    steps = read_log(result.log_path)
    assert result.steps == 8 and [r["epoch"] for r in steps] == [0] * 4 + [1] * 4
    start = read_log(result.log_path, "start")[0]
    assert start["steps_per_epoch"] == 4 and start["config"]["max_steps"] == 8 and start["config"]["epochs"] == 2
    # the fingerprint leaves out max_steps, which epochs overrule: another max_steps is the same run
    assert "max_steps" not in checkpoint.fingerprint(cfg, 1, 1, 1, 1)
    resumed = train(cfg.replace(max_steps=50))
    assert resumed.resumed_from == 7 and resumed.steps == 8
    # one epoch is 4 steps, behind the checkpoint: refused once the data is read, even with resume=force
    with pytest.raises(ResumeMismatch, match=r"checkpoint is at step 7 and the run has 4 steps: nothing left"):
        train(cfg.replace(epochs=1, resume="force"))
