"""Chapter 06's local launcher for real: a 2-stage job run by it (where no Slurm is), token for token against one
stage. The rest of the chapter's plumbing is tests/unit/test_ch06.py."""

from __future__ import annotations

import sys

from distlab.chapters import ch06
from distlab.launch.sbatch import SlurmSpec


def test_a_two_stage_job_run_by_the_local_launcher_gives_the_one_stage_tokens(tmp_path):
    from distlab.inference import outputs  # deferred: with this launch test only
    from distlab.inference.stage_weights import random_checkpoint  # deferred: as above

    model = random_checkpoint("test-tiny")
    spec = SlurmSpec("local-s2", args=["--max-new-tokens", "4", "--num-prompts", "4", "--batch-size", "2"],
                     model_dir=str(model), out_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "logs"),
                     script_dir=str(tmp_path / "job"), time="00:02:00")
    job_id, rec = ch06.run_job(None, spec, 120, env={"PYTHON": sys.executable})
    assert rec["State"] == "COMPLETED" and rec["ExitCode"] == "0:0" and rec["Partition"] == "local", rec
    assert (tmp_path / "job" / "submit.sbatch").is_file()
    assert "no Slurm" in (tmp_path / "logs" / f"local-s2-{job_id}.out").read_text()
    assert all((tmp_path / "logs" / f"local-s2-{job_id}-rank{t}.log").is_file() for t in (0, 1))
    run = outputs.load_run(tmp_path / "out" / str(job_id))
    assert run["summary"]["stages"] == 2 and run["summary"]["slurm_job_id"] == str(job_id)
    one_stage = ch06._uninterrupted_in_process(model, None, 4, 2, 4)
    assert outputs.token_mismatches(outputs.completions(tmp_path / "out" / str(job_id)), one_stage) == []
