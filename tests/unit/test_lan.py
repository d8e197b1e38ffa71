"""Chapter 05's emulated LAN, the parts that need no cluster: the rows each rank gets from uneven shares (the global
batch kept), and the localhost checklist with or without iproute2. The namespaces, the uneven-batch gradient, balancing
and the failures for real: tests/clusters/test_lan_runs.py.
"""

from __future__ import annotations

import shutil
import socket

import pytest

from distlab.batching import StepBatches, rows_per_rank
from distlab.lan import diagnose, host_runs, hosts

# ---------------------------------------------------------------------- fast: the split itself

def test_rows_per_rank_split():
    assert rows_per_rank(12, [2, 1], 2) == [8, 4]
    assert rows_per_rank(12, [1, 0.5, 0.5], 3) == [6, 3, 3]
    assert sum(rows_per_rank(13, [0.7, 0.2, 0.1], 3, minimum=2)) == 13
    assert min(rows_per_rank(6, [100, 1, 1], 3, minimum=2)) == 2
    # in proportion first, then the minimum: a host 4x slower gets its 2.4 rows' worth, not 3 of 12
    assert rows_per_rank(12, [1, 0.25], 2) == [10, 2]
    assert rows_per_rank(6, [100, 1, 1], 3) == [4, 1, 1]
    with pytest.raises(ValueError, match="entries for 3"):
        rows_per_rank(12, [1, 1], 3)


@pytest.mark.parametrize("shares,accum", [([2, 1], 1), ([3, 1], 2), ([1, 0.5, 0.5], 2)])
def test_uneven_shares_keep_the_global_batch(shares, accum):
    """Each step's rows over all ranks are exactly the equal split's: only the cut differs."""
    world = len(shares)
    equal = [StepBatches(60, 2, accum, world, r, 3) for r in range(world)]
    uneven = [StepBatches(60, 2, accum, world, r, 3, shares) for r in range(world)]
    assert uneven[0].steps_per_epoch == equal[0].steps_per_epoch
    for _ in range(uneven[0].steps_per_epoch + 2):  # across an epoch boundary too
        a = sorted(i for b in equal for mb in b.next_step() for i in mb)
        steps = [b.next_step() for b in uneven]
        assert all(len(s) == accum and all(s) for s in steps)
        assert sorted(i for s in steps for mb in s for i in mb) == a


# ---------------------------------------------------------------------- the localhost fallback: no `ip`, no /dev/tcp

@pytest.mark.parametrize("network_tools", [False, True])
def test_the_checklist_runs_on_localhost_with_or_without_iproute2(network_tools):
    """Without `ip` (macOS, Linux without iproute2) the interfaces come from psutil and the port is probed from
    Python: the checklist starts no command the machine lacks (no `ip`, no bash /dev/tcp, no `timeout`)."""
    if network_tools and not shutil.which("ip"):
        pytest.skip("iproute2 is not installed here: only the psutil path can run")
    local = host_runs.place(2, force_local=True)
    with socket.socket() as s:  # a free port for the listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = diagnose.checklist(local, port, network_tools=network_tools)
    assert [r["ok"] for r in rows] == [True] * 4, rows  # 2 interfaces, the listening port, host 1 reaches it
    assert ("psutil" in rows[0]["detail"]) != network_tools and rows[-1]["detail"] == "connected"


def test_without_iproute2_no_namespace_is_looked_for(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no `ip` on PATH, as on macOS
    assert hosts.namespaces() == [] and hosts.available()[0] is False
