"""Chapter 06 (Slurm pipeline inference): a finished run's stage timeline, one row per stage, one bar per
forward (prefill darker), micro-batches told apart by colour (the run is read by
distlab.inference.outputs.load_run)."""

from __future__ import annotations

import matplotlib.pyplot as plt


def plot_timeline(ax, stages: list[dict], until_s: float | None = None) -> None:
    """Each stage's forwards as bars over time (ms): who works while whom waits."""
    # deferred: matplotlib only when drawing

    cmap = plt.get_cmap("tab10")
    t0 = min(e["start"] for s in stages for e in s["events"])
    for s in stages:
        for e in s["events"]:
            if until_s is not None and e["start"] - t0 > until_s:
                continue
            ax.broken_barh([((e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3)], (s["rank"] - 0.4, 0.8),
                           facecolors=cmap(e["mb"] % 10), alpha=1.0 if e["kind"] == "prefill" else 0.6,
                           edgecolor="black" if e["kind"] == "prefill" else "none", linewidth=0.5)
    ax.set_yticks([s["rank"] for s in stages], [f"stage {s['rank']}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time since generation started (ms)")


# --- stage-loss demo (resume) below ---


def stage_loss_demo(cluster, model_dir, *, run_root, log_dir, job_dir, prompts: int = 8, batch_size: int = 2,
                    kill_after: int = 2, max_new_tokens: int = 24, adapter=None, job_time: str = "00:05:00",
                    timeout_s: float = 300, resubmit: str = "sbatch", reference=None) -> dict:
    """A stage lost mid-job, and the job finished by submitting it again.

    Two 2-stage Slurm jobs of one resumable script (SlurmSpec(resumable=True): a stable output folder,
    --resume, --requeue): the run whose last stage (rank 1) SIGKILLs itself once `kill_after` micro-batches
    are written (DISTLAB_KILL_AFTER_MICRO_BATCHES), and its resubmission (`resubmit`: "sbatch" submits the
    script again, a new job id; "requeue" runs the same job id again). Two micro-batches are in flight, so
    micro-batches finish, and are written, one pair after another. The answers are compared with an
    uninterrupted run of the same prompts and micro-batches: one stage in this process (the number of
    stages does not change a greedy answer; the chapter checks that first), or `reference`, a finished
    run's folder. Returns the counts and checks the chapter asserts: which rank the failed job names,
    prompts answered before the kill and by the resubmission, the total against the prompt count, prompts
    answered twice, and whether every answer's tokens equal the uninterrupted run's."""
    import json  # deferred: the stage-loss demo alone submits jobs and reads their files
    import re  # deferred: as above
    import shutil  # deferred: as above
    import sys  # deferred: as above
    from collections import Counter  # deferred: as above
    from pathlib import Path  # deferred: as above

    from distlab.inference import outputs  # deferred: as above
    from distlab.inference.resume import COMPLETIONS  # deferred: as above
    from distlab.launch.sbatch import SlurmSpec  # deferred: as above (distlab.launch loads the strategies)
    from distlab.slurm import submit  # deferred: as above

    if resubmit not in ("sbatch", "requeue"):
        raise ValueError(f"resubmit={resubmit!r}: 'sbatch' or 'requeue'")
    run_root, log_dir, job_dir = Path(run_root), Path(log_dir), Path(job_dir)
    args = ["--max-new-tokens", str(max_new_tokens), "--num-prompts", str(prompts), "--batch-size", str(batch_size),
            "--in-flight", "2", *(["--adapter", str(adapter)] if adapter else [])]

    def spec(name):
        return SlurmSpec(name, args=args, nodes=2, tasks_per_node=1, cpus_per_task=1, time=job_time, partition="debug",
                         model_dir=str(model_dir), out_dir=str(run_root), log_dir=str(log_dir),
                         script_dir=str(job_dir / name), resumable=True,
                         description="2-stage pipeline inference that a resubmission finishes")

    env = {"PYTHON": sys.executable}
    shutil.rmtree(run_root / "stage-loss", ignore_errors=True)  # a resumable job skips what it finds there
    if reference is None:
        ref_rows = _uninterrupted_in_process(model_dir, adapter, prompts, batch_size, max_new_tokens)
    else:
        ref_rows = outputs.completions(reference)
    kill = {"DISTLAB_KILL_AFTER_MICRO_BATCHES": str(kill_after), "DISTLAB_KILL_RANK": "1"}
    lost_id, lost_rec = submit.run_spec(cluster, spec("stage-loss"), timeout_s, env={**env, **kill})
    failed = re.findall(r"task (\d+): Killed", (log_dir / f"stage-loss-{lost_id}.out").read_text())
    before = outputs.completions(run_root / "stage-loss")
    if resubmit == "requeue":  # the same job id again; Slurm's SLURM_RESTART_COUNT=1 disarms the kill
        again_rec = submit.requeue(cluster, lost_id, timeout_s)
    else:
        _, again_rec = submit.run_spec(cluster, spec("stage-loss"), timeout_s, env=env)
    after = outputs.completions(run_root / "stage-loss")
    ids = [json.loads(line)["id"] for line in (run_root / "stage-loss" / COMPLETIONS).read_text().splitlines()]
    summary = json.loads((run_root / "stage-loss" / "summary.json").read_text())
    return {"prompts": prompts, "micro_batches": -(-prompts // batch_size),
            "lost_job": lost_rec["State"],
            "failed_rank": int(failed[0]) if failed else None, "answered_before_kill": len(before),
            "resubmission": f"{resubmit}: {again_rec['State']}",
            "answered_by_resubmission": summary["answered_now"], "total_answered": len(after),
            "answered_twice": sum(n - 1 for n in Counter(ids).values()),
            "identical_to_uninterrupted": not outputs.token_mismatches(after, ref_rows)}


def _uninterrupted_in_process(model_dir, adapter, prompts: int, batch_size: int, max_new_tokens: int) -> list[dict]:
    """The same prompts and micro-batches, greedy, as one stage in this process that nobody interrupts."""
    from transformers import AutoConfig  # deferred: transformers is slow to import

    from distlab.inference.batches import micro_batches, read_prompts  # deferred: the stage-loss demo only
    from distlab.inference.engine import Pipeline, Sampling  # deferred: as above
    from distlab.inference.run import completion_rows, repeat_prompts  # deferred: as above
    from distlab.inference.stage import InferenceStage  # deferred: as above
    from distlab.models import load_tokenizer  # deferred: as above
    from distlab.paths import DEMO_PROMPTS  # deferred: as above

    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
    stage = InferenceStage(config, range(config.num_hidden_layers), first=True, last=True)
    stage.load(model_dir, adapter)
    tokenizer = load_tokenizer(model_dir)
    batches = micro_batches(tokenizer, repeat_prompts(read_prompts(DEMO_PROMPTS), prompts), batch_size)
    pipe = Pipeline(stage, 0, 1, config, tokenizer.eos_token_id, tokenizer.pad_token_id, Sampling(max_new_tokens))
    return completion_rows(pipe.run(batches), tokenizer)
