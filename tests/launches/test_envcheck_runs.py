"""Notebook 00's library under real launches (2 gloo ranks): the cross-rank fingerprint agreeing, a perturbed
rank flagged, the all-reduce sweep's bus bandwidth and limits table, and a timed-out launch leaving no process.
The report, the sampler and the utilisation plots in one process: tests/unit/test_envcheck.py."""

from __future__ import annotations

import re

import psutil
import pytest

from distlab import device
from distlab.launch import process
from distlab.measure import envcheck, limits
from distlab.workers import launcher

TINY_SIZES_KIB = [4, 64]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One short all-reduce run shared by the tests that only read its result."""
    out = tmp_path_factory.mktemp("allreduce") / "allreduce.json"
    return launcher.run_allreduce_bench(nproc=2, sizes_kib=TINY_SIZES_KIB, timeout_s=90,
                                      seconds_per_size=0.05, out_json=out, echo=False)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_agrees_across_two_ranks(tmp_path):
    df = launcher.run_fingerprint(nproc=2, timeout_s=90, out_json=tmp_path / "fp.json", echo=False)
    assert {"field", "rank0", "rank1", "MISMATCH"} <= set(df.columns)
    assert not df["MISMATCH"].any(), df[df["MISMATCH"]]
    torch_row = df.set_index("field").loc["torch"]
    assert torch_row["rank0"] == torch_row["rank1"] == envcheck.fingerprint()["torch"]


def test_fake_perturbation_on_rank1_is_flagged(tmp_path):
    env = {envcheck.FAKE_RANK1_ENV: "peft=0.0.0-fake"}
    df = launcher.run_fingerprint(nproc=2, timeout_s=90, out_json=tmp_path / "fp.json", env=env, echo=False)
    flagged = df[df["MISMATCH"]]
    assert list(flagged["field"]) == ["peft"]
    assert flagged["rank1"].iloc[0] == "0.0.0-fake"


# ---------------------------------------------------------------- limits

def test_allreduce_bench_busbw(sweep):
    assert list(sweep["size_bytes"]) == [kib * 1024 for kib in TINY_SIZES_KIB]
    assert (sweep["busbw_GBps"] > 0).all() and (sweep["iters"] >= 1).all()
    n = sweep["world_size"].iloc[0]
    assert n == 2
    expected = sweep["algbw_GBps"] * 2 * (n - 1) / n
    assert ((sweep["busbw_GBps"] - expected).abs() <= 1e-9 * expected).all()
    # algbw is bytes over the measured time per op
    recomputed = sweep["size_bytes"] / (sweep["time_us"] * 1e-6) / 1e9
    assert ((sweep["algbw_GBps"] - recomputed).abs() <= 1e-6 * recomputed).all()
    # rank 0's phases, wall clock, one after the other: imports, rendezvous, one per size
    phases = sweep.attrs["phases"]
    assert [p[2] for p in phases] == ["python, import torch", "rendezvous", "4 KiB", "64 KiB"]
    assert all(start <= end for start, end, _ in phases)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(phases, phases[1:]))


def test_limits_table_round_trips(sweep, tmp_path):
    table = limits.measure_device_limits("cpu", matmul_seconds=0.05, allreduce=sweep, memory_bytes=8 * 2**20)
    assert set(table["metric"]) == {"matmul", "memory_bandwidth", "allreduce_busbw", "allreduce_latency"}
    assert (table["value"] > 0).all()
    path = limits.save_device_limits(table, tmp_path)
    assert path == tmp_path / "device_limits.csv"
    assert (tmp_path / "device_limits.csv.provenance.json").exists()
    back = limits.load_device_limits(tmp_path)
    assert list(back["metric"]) == list(table["metric"])
    assert back["value"].tolist() == pytest.approx(table["value"].tolist())
    assert limits.lookup(back, "matmul", dtype="fp32", workers=1) == pytest.approx(
        limits.lookup(table, "matmul", dtype="fp32", workers=1))
    # bf16 rows exactly where bf16 matmuls are native (chapter 01 trains in bf16 there)
    assert ("bf16" in set(table["dtype"])) == device.native_bf16("cpu")


def test_timed_out_launch_leaves_no_process(tmp_path):
    seen_pids: list[int] = []

    def collect(line: str) -> None:
        m = re.search(r"allreduce_bench: rank \d+/\d+ pid (\d+)", line)
        if m:
            seen_pids.append(int(m.group(1)))

    with pytest.raises(process.RunFailed) as err:
        launcher.run_allreduce_bench(nproc=2, sizes_kib=[4], timeout_s=8, seconds_per_size=600,
                                   max_iters=10**9, out_json=tmp_path / "ar.json", echo=collect)
    assert err.value.result.timed_out
    assert seen_pids, "the ranks never started, so the test proved nothing"
    survivors = [pid for pid in seen_pids if _alive(pid)]
    assert not survivors
    workers = [p for p in psutil.Process().children(recursive=True) if _is_worker(p)]
    assert not workers


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_worker(p) -> bool:
    try:
        return any("distlab.workers" in c or "torch.distributed.run" in c for c in p.cmdline())
    except psutil.Error:
        return False
