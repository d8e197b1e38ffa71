"""Notebook 00's library: environment report, fingerprint comparison, limits file, sampler, utilisation plots.
Its launches (the fingerprint across two ranks, the all-reduce sweep): tests/launches/test_envcheck_runs.py."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from distlab.measure import envcheck, limits, utilisation

# ---------------------------------------------------------------- environment report

def test_environment_report_fields():
    report = envcheck.environment_report()
    assert {"versions", "accelerators", "backends_available", "backend_used_here", "cpu"} <= set(report)
    assert report["versions"]["torch"].startswith("2.")
    assert report["versions"]["python"].count(".") == 2
    assert set(report["backends_available"]) == {"nccl", "gloo", "mpi"}
    assert report["backends_available"]["gloo"]
    has_gpu = bool(report["accelerators"])
    assert report["backend_used_here"] == ("nccl" if has_gpu else "gloo")
    assert report["cpu"]["usable_cores"] >= 1 and report["cpu"]["ram_total_gib"] > 0
    table = envcheck.report_table(report)
    assert list(table.columns) == ["section", "item", "value"]
    assert "torch" in set(table["item"])


def test_report_does_not_import_deepspeed():
    # In a fresh interpreter: another test may have imported it into this one.
    code = ("import sys; from distlab.measure import envcheck; envcheck.environment_report(); "
            "envcheck.fingerprint(); assert 'deepspeed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- fingerprint

def test_compare_fingerprints_separates_mismatch_from_node_identity():
    a = {"torch": "2.13.0", "hostname": "node0"}
    b = {"torch": "2.12.0", "hostname": "node1"}
    rows = {r["field"]: r for r in envcheck.compare_fingerprints([a, b])}
    assert rows["torch"]["MISMATCH"] and rows["torch"]["differs"]
    assert rows["hostname"]["differs"] and not rows["hostname"]["MISMATCH"]
    assert rows["torch"]["rank1"] == "2.12.0"


# ---------------------------------------------------------------- limits


def test_loading_missing_limits_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        limits.load_device_limits(tmp_path)
    assert str(tmp_path / "device_limits.csv") in str(err.value)
    assert "00_environment_check" in str(err.value)


# ---------------------------------------------------------------- sampler

BURN = """
import time
ballast = bytearray(80 * 2**20)  # RSS the sampler must see
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
t0 = time.perf_counter()
while time.perf_counter() - t0 < 1.5:
    pass
"""


def test_sampler_records_a_busy_child(tmp_path):
    csv_path = tmp_path / "util.csv"
    with utilisation.UtilizationSampler(csv_path, interval_s=0.2, pids="children", source="process") as sampler:
        child = subprocess.Popen([sys.executable, "-c", BURN])
        child.wait(timeout=30)
    assert not sampler.errors
    import pandas as pd

    df = pd.read_csv(csv_path, dtype={"id": str})
    mine = df[df["id"] == str(child.pid)]
    assert len(mine) >= 2
    assert mine["util_pct"].max() > 30  # a busy loop holds most of one core
    assert mine["mem_mib"].max() > 70


def test_a_ranks_subprocess_is_not_labelled_as_the_rank():
    # A torchrun rank's children inherit RANK and TORCHELASTIC_RUN_ID: `accept` once read an idle `git`
    # started by rank 1 as an idle rank 1.
    env = {"RANK": "1", "TORCHELASTIC_RUN_ID": "t", "PATH": "/usr/bin:/bin"}
    rank = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '5'])"], env=env)
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(rank.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(rank.pid).children()[0]
        assert utilisation._role(psutil.Process(rank.pid)) == "rank 1"
        assert utilisation._role(child) == "sleep (child of rank 1)"
    finally:
        for p in psutil.Process(rank.pid).children() + [psutil.Process(rank.pid)]:
            p.kill()
        rank.wait(timeout=10)


def test_sampler_never_raises_into_the_caller(tmp_path):
    # An unwritable path: the sampler notes the problem, the caller's block still runs.
    blocker = tmp_path / "file"
    blocker.write_text("")
    with utilisation.UtilizationSampler(blocker / "sub" / "util.csv", interval_s=0.05, source="process") as s:
        time.sleep(0.1)
    assert s.errors


def test_gpu_tool_output_is_parsed():
    # No GPU here: check the parsers on the tools' documented output formats instead.
    nvidia = utilisation._parse_nvidia("0, NVIDIA H100 80GB HBM3, 87, 40321\n1, NVIDIA H100 80GB HBM3, [N/A], 12\n")
    assert [r["util_pct"] for r in nvidia][0] == 87 and nvidia[1]["mem_mib"] == 12
    assert nvidia[1]["util_pct"] != nvidia[1]["util_pct"]  # NaN for [N/A]
    rocm = utilisation._parse_rocm('{"card0": {"GPU use (%)": "55", "VRAM Total Memory (B)": "68702699520", '
                               '"VRAM Total Used Memory (B)": "1073741824"}, "system": {}}')
    assert rocm == [{"id": "0", "label": "gpu0", "util_pct": 55.0, "mem_mib": 1024.0}]


def _timeline_csv(path):
    rows = [{"t_s": t, "source": "process", "id": pid, "label": label, "util_pct": 50.0, "mem_mib": 100.0 + t}
            for t in (0.0, 0.5, 1.0, 1.5) for pid, label in (("1", "rank 0 (pid 1)"), ("2", "rank 1 (pid 2)"))]
    import pandas as pd

    pd.DataFrame(rows, columns=utilisation.FIELDS).to_csv(path, index=False)
    return path


STAMP = {"device": "test", "model": "none", "world_size": 2, "commit": "abc1234", "date": "2026-01-01 00:00 UTC"}


def test_plot_utilization_marks_spans_and_events(tmp_path):
    csv_path = _timeline_csv(tmp_path / "util.csv")
    spans = [(0.0, 0.4, "python, import torch"), (0.4, 0.45, "rendezvous"), (0.45, 0.5, "4 KiB"), (0.5, 1.5, "exit")]
    fig = utilisation.plot_utilization(csv_path, tmp_path / "u.png", STAMP, spans=spans,
                                       events=[(1.2, "rank 1 killed")])
    strip, util, mem = fig.axes[:3]
    labels = sorted(t.get_text() for t in strip.texts)
    assert labels == sorted([s[2] for s in spans] + ["rank 1 killed"])
    xs = sorted(t.get_position()[0] for t in strip.texts)
    assert all(b > a for a, b in zip(xs, xs[1:]))  # neighbours never share a place
    assert len(util.patches) == len(spans) and len(mem.patches) == len(spans)
    assert (tmp_path / "u.png.provenance.json").exists()


def test_events_alone_are_labelled_across_a_short_strip(tmp_path):
    """Without phases nothing needs upright labels: a short strip, the event lines drawn through it, labels
    beside them in alternating rows."""
    events = [(0.6, "rank 1 killed"), (1.2, "resumed (step 4)")]
    fig = utilisation.plot_utilization(_timeline_csv(tmp_path / "util.csv"), tmp_path / "u.png", STAMP, events=events)
    strip, util = fig.axes[:2]
    assert [t.get_text().strip() for t in strip.texts] == [e[1] for e in events]
    assert all(t.get_rotation() == 0 for t in strip.texts) and len({t.xy[1] for t in strip.texts}) == 2
    assert len(strip.lines) == len(util.lines) - 2 == 2  # two processes' lines below, the events' in both
    assert strip.get_position().height < 0.2 * util.get_position().height


def test_plot_utilization_without_marks_keeps_two_plots(tmp_path):
    fig = utilisation.plot_utilization(_timeline_csv(tmp_path / "util.csv"), tmp_path / "u.png", STAMP)
    assert len(fig.axes) == 2


def test_since_start_maps_wall_clock_onto_the_csv_clock(tmp_path):
    before = time.time()
    with utilisation.UtilizationSampler(tmp_path / "util.csv", interval_s=0.05, source="process") as sampler:
        time.sleep(0.1)
    assert before <= sampler.started_at <= time.time()
    assert sampler.since_start(sampler.started_at + 2.5) == pytest.approx(2.5)


def test_a_label_read_before_exec_is_read_again():
    # Between fork and exec a child still shows its parent's command line: 'python', not what it becomes.
    tree = utilisation.ProcessTree()
    me = psutil.Process()
    key = (me.pid, me.create_time())
    assert tree._label(me, key) == f"this process (pid {me.pid})"
    assert key not in tree._labels  # not a rank: read again next time
