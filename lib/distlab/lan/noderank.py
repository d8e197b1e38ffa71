"""A node started with the wrong node rank: the per-node script refuses before torchrun starts.

    placement = host_runs.place(2)
    with placement.running():
        r = wrong_node_rank_demo(placement)    # node0.sh (node rank 0) started on host 1 as well
    print(r["line"])

With a static rendezvous every node's script carries its node rank. Started on the wrong machine (the
same script copied to two hosts, a node rank typed twice), torchrun cannot tell: two "node 0"s each
host a rendezvous store of their own and wait for a node that never comes. Measured here (torch 2.13,
the checks skipped): node0.sh on both hosts, or --node-rank 2 of 2, printed nothing and ran until the
script's time limit (40 s, exit 124) on both hosts. The generated scripts (distlab.launch.torchrun,
when the spec names each node's host) check first that they run on the host their node rank was
assigned, and refuse in one line naming both hosts; distlab.lan.diagnose's "wrong node rank" rule reads
that line. (A node rank >= nnodes cannot be generated: LaunchSpec rejects it.)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from distlab.lan import host_runs
from distlab.lan.diagnose import diagnose
from distlab.launch.process import run
from distlab.launch.torchrun import HOST_MISMATCH_EXIT, write_scripts
from distlab.paths import BUILD_DIR, REPO_ROOT


def wrong_node_rank_demo(placement: host_runs.Placement, *, script_rank: int = 0, host: int = 1, timeout_s: int = 60,
                         name: str = "wrong_rank", echo=False) -> dict[str, Any]:
    """Start node `script_rank`'s script on host `host` (a node rank that belongs to another host)."""
    if placement.cluster is None:
        raise RuntimeError(f"the wrong-host check needs the namespace cluster: {placement.why_local}")
    spec = host_runs.module_spec(placement, name, "distlab.workers.fingerprint",
                            ["--out", str(BUILD_DIR / "lan" / f"{name}.json")], timeout_s=timeout_s)
    scripts = write_scripts(spec, host_runs.SCRIPTS_DIR, name)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(f"[{placement.name(host)}] {line}")
        if echo:
            print(lines[-1], flush=True)

    start = time.monotonic()
    res = run([*placement.prefix(host), "bash", str(scripts[script_rank])], timeout_s=timeout_s + 20, echo=emit,
              check=False, cwd=REPO_ROOT, env={"PYTHON": sys.executable},
              log_path=host_runs.SCRIPTS_DIR.parent / "logs" / name / f"host{host}.log")
    elapsed = time.monotonic() - start
    found = diagnose(lines)
    line = next((d["line"] for d in found if d["rule"] == "wrong node rank"), lines[-1] if lines else "")
    return {"script": str(scripts[script_rank]), "host": placement.name(host), "returncode": res.returncode,
            "refused": res.returncode == HOST_MISMATCH_EXIT, "elapsed_s": elapsed, "line": line, "diagnosis": found,
            "lines": lines}
