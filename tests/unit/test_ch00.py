"""Chapter 00's plumbing: the ring all-reduce simulated and drawn, the by-hand timing read back, the
latency-bandwidth prediction and the sweep's phases for the utilisation timeline."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from matplotlib.figure import Figure

from distlab.chapters import ch00

STAMP = {"device": "test", "model": "none", "world_size": 4, "commit": "abc1234", "date": "2026-01-01 00:00 UTC"}


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_the_ring_sums_every_chunk_on_every_rank(n):
    steps = ch00.ring_allreduce_steps(n)
    assert len(steps) == 1 + 2 * (n - 1)
    everyone = frozenset(range(n))
    after_reduce_scatter = steps[n - 1]["state"]
    for r in range(n):  # rank r owns the full sum of chunk r + 1, and only that one
        full = [c for c in range(n) if after_reduce_scatter[r][c] == everyone]
        assert full == [(r + 1) % n]
    assert all(chunk == everyone for row in steps[-1]["state"] for chunk in row)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_rank_sends_2_n_minus_1_chunks_to_its_right_neighbour(n):
    steps = ch00.ring_allreduce_steps(n)
    assert ch00.chunks_sent_per_rank(steps, n) == [2 * (n - 1)] * n
    assert all(dst == (src + 1) % n for step in steps for src, dst, _ in step["sends"])
    # 2(n-1) chunks of B/n bytes: the bus factor busbw is defined with
    assert 2 * (n - 1) / n == pytest.approx(ch00.bus_factor(n))


def test_a_ring_needs_two_ranks():
    with pytest.raises(ValueError, match="at least 2"):
        ch00.ring_allreduce_steps(1)


@pytest.mark.parametrize("n", [2, 4])
def test_draw_ring_allreduce_saves_with_provenance(tmp_path, n):
    fig = ch00.draw_ring_allreduce(n, tmp_path / "ring.png", STAMP)
    assert isinstance(fig, Figure)
    assert (tmp_path / "ring.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "ring.png.provenance.json").read_text())["commit"] == "abc1234"


def test_by_hand_output_is_read_back():
    lines = ["W1126 some torchrun warning", "by hand: size_bytes=4096 time_us=812.5 busbw_GBps=0.0050",
             "by hand: size_bytes=67108864 time_us=95000.0 busbw_GBps=0.7064"]
    table = ch00.parse_by_hand(lines)
    assert table["size_bytes"].tolist() == [4096, 67108864]
    assert table["time_us"].tolist() == [812.5, 95000.0]
    with pytest.raises(ValueError, match="by hand"):
        ch00.parse_by_hand(["nothing here"])


def test_alpha_beta_prediction_goes_through_its_two_inputs():
    by_hand = pd.DataFrame({"size_bytes": [4096, 2**26], "time_us": [1000.0, 100_000.0],
                            "busbw_GBps": [0.004, 2**26 / 0.1 / 1e9]})
    predicted = ch00.alpha_beta_prediction(by_hand, [4, 1024, 65536], world_size=2)
    alpha_us, seconds_per_byte = 1000.0, 0.1 / 2**26
    expected = [alpha_us + b * seconds_per_byte * 1e6 for b in (4096, 2**20, 2**26)]
    assert predicted["predicted_us"].tolist() == pytest.approx(expected)
    assert predicted["size"].tolist() == ["4 KiB", "1 MiB", "64 MiB"]
    assert predicted["bandwidth_bound"].tolist() == [False, True, True]  # B1/2 = 1 ms x 0.67 GB/s: 0.64 MiB
    sweep = pd.DataFrame({"size_bytes": [4096, 2**20], "time_us": [2000.0, 2700.0], "busbw_GBps": [0.002, 0.4]})
    table = ch00.against_prediction(predicted, sweep)
    assert list(table.index) == ["4 KiB", "1 MiB"]  # only the sizes both have
    assert table.loc["4 KiB", "measured / predicted"] == pytest.approx(2000.0 / expected[0])


def test_by_hand_is_set_beside_the_library_at_the_same_sizes():
    by_hand = pd.DataFrame({"size_bytes": [4096], "time_us": [900.0], "busbw_GBps": [0.0045]})
    sweep = pd.DataFrame({"size_bytes": [4096, 65536], "time_us": [1000.0, 1500.0], "busbw_GBps": [0.004, 0.04]})
    table = ch00.by_hand_against_library(by_hand, sweep)
    assert table.loc["4 KiB", "by hand / library"] == pytest.approx(0.9)
    ends = ch00.latency_and_plateau(sweep)
    assert ends["size"].tolist() == ["4 KiB", "64 KiB"]


class _Sampler:
    started_at = 1000.0

    def since_start(self, wall_time):
        return wall_time - self.started_at


def test_sweep_phases_are_in_the_sampler_clock_from_launch_to_return():
    sweep = pd.DataFrame({"size_bytes": [4096]})
    sweep.attrs["phases"] = [(1001.0, 1003.0, "python, import torch"), (1003.0, 1003.5, "rendezvous"),
                             (1003.5, 1004.0, "4 KiB")]
    spans = ch00.sweep_phases(sweep, _Sampler(), launched=1000.5, returned=1005.0)
    assert spans[0] == (0.5, 1.0, "torchrun starts")
    assert spans[-1] == (4.0, 5.0, "exit")
    assert [s[2] for s in spans[1:-1]] == ["python, import torch", "rendezvous", "4 KiB"]


def test_busbw_figure_with_the_prediction(tmp_path):
    sweep = pd.DataFrame({"size_bytes": [4096, 2**20], "time_us": [1000.0, 2500.0], "busbw_GBps": [0.004, 0.42],
                          "algbw_GBps": [0.004, 0.42], "backend": "gloo", "world_size": 2})
    by_hand = sweep[["size_bytes", "time_us", "busbw_GBps"]]
    fig = ch00.plot_allreduce_busbw(sweep, tmp_path / "busbw.png", STAMP, by_hand=by_hand)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "busbw predicted from the by-hand run" in labels and "busbw by hand" in labels
    assert (tmp_path / "busbw.png.provenance.json").exists()


def test_halves_line_and_phase_kinds():
    halves = ch00.parse_halves(["halves: max_abs_diff=0.0 reduce_scatter_us=812 all_gather_us=400 all_reduce_us=900"])
    assert halves["max_abs_diff"] == 0 and halves["reduce_scatter_us"] == 812
    spans = [(0.0, 1.0, "torchrun starts"), (1.0, 4.0, "python, import torch"), (4.0, 4.1, "rendezvous"),
             (4.1, 4.6, "4 KiB"), (4.6, 5.0, "exit")]
    by_kind = ch00.phase_durations(spans).groupby("kind")["seconds"].sum()
    assert by_kind.to_dict() == pytest.approx({"start-up": 4.1, "all-reduce": 0.5, "exit": 0.4})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_recorded_ring_rebuilds_the_schedule(n):
    """What the chapter's by-hand ring records (the chunk each rank sent, each chunk's sum of 2^rank values)
    gives back ring_allreduce_steps, and a wrong send shows."""
    steps = ch00.ring_allreduce_steps(n)
    records = [[{"sent": next((c for src, _, c in st["sends"] if src == r), None),
                 "chunks": [sum(2**b for b in summed) for summed in st["state"][r]]} for st in steps] for r in range(n)]
    assert ch00.ring_steps_from_record(records) == steps
    records[0][1]["sent"] = (records[0][1]["sent"] + 1) % n
    assert ch00.ring_steps_from_record(records) != steps
