"""The one training loop from the command line: `python -m distlab.train` with a YAML config and --set overrides,
in a process of its own. The loop itself, in one process: tests/unit/test_train.py."""

from __future__ import annotations

import json
import subprocess
import sys

from distlab.metrics import read_log


def test_cli_with_yaml_and_overrides(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"max_steps: 2\nseq_len: 256\nmicro_batch_size: 2\nnum_threads: 1\neval_file: null\n"
                      f"output_dir: {tmp_path / 'out'}\nprogress: false\n")
    proc = subprocess.run([sys.executable, "-m", "distlab.train", "--config", str(config), "--set", "logging_steps=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(read_log(tmp_path / "out" / "train_log.jsonl")) == 2
    assert json.loads(proc.stdout.strip().splitlines()[-1])["final_loss"] > 0
