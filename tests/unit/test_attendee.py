"""The attendee run's pieces (the run itself is tests/notebooks/test_notebooks.py): the PATH it hides tools from, the
lanes that keep a chapter after the one whose output it reads, and the skipped lines it reports."""

from __future__ import annotations

import json
import os
import subprocess

from distlab import paths
from distlab.publish import attendee


def test_the_reduced_path_keeps_every_tool_but_the_hidden_ones(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("python3", "timeout", "ip", "tc", "sbatch", "g++", "ls"):
        (tools / name).write_text("#!/bin/sh\n")
        (tools / name).chmod(0o755)
    (tools / "notes.txt").write_text("not a tool")
    folder = attendee.reduced_path(tmp_path / "bin", f"{tools}{os.pathsep}/nonexistent")
    assert sorted(p.name for p in folder.iterdir()) == ["ls", "python3"]
    out = subprocess.run(["/bin/sh", "-c", "command -v timeout ip tc g++ || echo none"], capture_output=True,
                         text=True, env={"PATH": str(folder)})
    assert out.stdout.strip() == "none"


def test_every_chapter_runs_once_and_after_the_chapter_it_reads():
    lanes = attendee.split_lanes(None, 2)
    flat = [c for lane in lanes for c in lane]
    assert sorted(flat) == ["00", "01", "02", "03", "04", "05", "06", "07", "08"] and len(set(flat)) == len(flat)
    assert sorted(flat) == sorted(nb.name[:2] for nb in paths.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")), "a lane each"
    for first, then in (("00", "02"), ("01", "06"), ("05", "08")):  # 02 reads 00's limits, 06 01's adapter;
        # 05 and 08 both start the emulated LAN on one fixed port: never side by side
        lane = next(lane for lane in lanes if then in lane)
        assert first in lane and lane.index(first) < lane.index(then)
    assert attendee.split_lanes(["06", "01"], 1) == [["01", "06"]]
    assert attendee.split_lanes(["05"], 2) == [["05"]]


def test_the_report_lists_what_each_chapter_skipped(tmp_path):
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout",
         "text": ["ranks: 2\n", "skipped: 5. The emulated LAN: needs root\n", "speed-up: shown, not asserted: x\n"]},
        {"output_type": "display_data", "data": {"text/plain": "skipped: not a print"}}]}]}
    (tmp_path / "05_lan.ipynb").write_text(json.dumps(nb))
    assert attendee.skipped_lines(tmp_path) == ["05: skipped: 5. The emulated LAN: needs root",
                                                "05: speed-up: shown, not asserted: x"]
