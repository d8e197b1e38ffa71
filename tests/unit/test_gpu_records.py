"""tools/gpu_results.py turns the lent-GPU sessions' raw logs into the tables and figure the GPU appendix shows."""

import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from distlab.paths import REPO_ROOT

SESSIONS = ("session_2026-11-26", "session_2026-11-27")


@pytest.mark.slow  # the tool's own interpreter (pandas, matplotlib): ~3 s
def test_the_records_redraw_from_the_sessions_logs(tmp_path):
    for name in SESSIONS:
        shutil.copytree(REPO_ROOT / "figures" / "gpu" / name, tmp_path / name)
    tool = REPO_ROOT / "tools" / "gpu_results.py"
    subprocess.run([sys.executable, str(tool), *(str(tmp_path / n) for n in SESSIONS)], check=True, capture_output=True,
                   text=True, timeout=120)
    ladder = pd.read_csv(tmp_path / "mfu_ladder.csv")
    assert list(ladder["rung"]) == list(range(7))
    # a later call with fixed code replaces a rung; a repeat made only to reach later rungs does not
    assert set(ladder.loc[ladder["rung"] >= 4, "call"]) == {"2026-11-26 call2"}
    sidecar = json.loads((tmp_path / "mfu_ladder.csv.provenance.json").read_text())
    assert [r["rung"] for r in sidecar["repeated_rows"]] == [6]
    assert "2026-11-27" not in sidecar["commit"] and "H100" in sidecar["device"]
    trainer = pd.read_csv(tmp_path / "trainer_vs_hf.csv")
    assert trainer.groupby("measured").size().tolist() == [4, 3]  # the second comparison was cut off before TRL
    assert (trainer.loc[trainer["framework"] == "hf_trainer", "vs_hf_trainer"] == 1).all()
    # what the book shows is what the tool writes
    committed = pd.read_csv(REPO_ROOT / "figures" / "gpu" / "trainer_vs_hf.csv")
    pd.testing.assert_frame_equal(trainer, committed)
