"""tools/gpu_session.sh, the exact script a lent GPU machine runs, dry-run on the CPU: its MFU ladder step alone, at
the tiny shape, through the script's own time boxes and tarball. A lent machine is ours for minutes, so what can
fail here (the script's arguments to the ladder, where the rungs log, what the tarball holds) is found here. Its
bash -n and shellcheck: tests/unit/test_mfu_ladder.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile

import pandas as pd

from distlab.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "gpu_session.sh"


def test_the_session_scripts_ladder_step_runs_on_a_cpu_and_brings_back_each_rungs_log(tmp_path):
    # the script's own ladder arguments (--from-rung 4 onwards, 90-s boxes), then these: two rungs without compile
    # (an inductor compile takes a minute on 2 cores), rows labelled at every token as the d20 row has them
    ladder_args = ("--model null --device cpu --dtype fp32 --seq-len 64 --steps 3 --warmup 1 --from-rung 3 "
                   "--rungs 5 --timeout 60 --labels all")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "ONLY": "mfu_ladder", "LADDER_ARGS": ladder_args,
           "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no_wheels")}
    done = subprocess.run(["bash", str(SCRIPT), "200"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== mfu_ladder: exit 0" in done.stdout, done.stdout
    with tarfile.open(tmp_path / "out" / "gpu_results.tgz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        table = pd.read_csv(io.BytesIO(tar.extractfile("./mfu_ladder.csv").read()), keep_default_na=False)
        log = tar.extractfile("./mfu_ladder.log").read().decode()
    assert {"mfu_ladder.log", "mfu_ladder.csv", "mfu_ladder.csv.provenance.json", "long_documents.jsonl"} <= names
    for rung in (3, 4):
        assert {f"rung{rung}/stdout.log", f"rung{rung}/train_log.jsonl"} <= names
    assert list(table["rung"]) == [3, 4] and (table["error"] == "").all(), table["error"].tolist()
    assert (table["tokens_per_s"] > 0).all() and (table["label_fraction"] > 0.7).all()
    assert "of them labelled; log: rung4/stdout.log" in log
