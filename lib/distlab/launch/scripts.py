"""A chapter's script run under torchrun on this machine, the way chapters 00-08 run the scripts their
notebooks write: `nproc` local gloo ranks, one thread each, in their own process group with a hard timeout
(distlab.launch.process), and what rank 0 printed after `RESULT ` read back as JSON.

    result = scripts.run_script(work / "hand_dp.py", nproc=2, timeout_s=300)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

from distlab import paths
from distlab.launch.process import run


def torchrun_module_or_script(target: str | Path, nproc: int = 2, args: Sequence[str] = (), timeout_s: int = 300,
                              module: bool = False, echo: bool = False):
    """Run a script (or `-m` module) on `nproc` local gloo ranks with torchrun, one thread per rank,
    in its own process group with a hard timeout (distlab.launch.process). Returns its RunResult."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", str(target)] if module else [str(target)]
    lib = str(paths.REPO_ROOT / "lib")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in (lib, os.environ.get("PYTHONPATH")) if p)}
    return run(cmd + list(args), timeout_s=timeout_s, env=env, echo=echo, cwd=paths.REPO_ROOT)


def result_line(run_result) -> dict:
    """The JSON a script printed after `RESULT ` (rank 0's), from the run's output."""
    for line in reversed(run_result.tail):
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise ValueError("the script printed no RESULT line:\n" + "\n".join(run_result.tail[-20:]))


def run_script(script: str | Path, nproc: int = 2, timeout_s: int = 300, args: Sequence = ()) -> dict:
    """Run a chapter's script on `nproc` local gloo ranks under torchrun (one thread each, a hard
    timeout), with `args` as its command line; returns the JSON rank 0 printed after `RESULT `."""
    return result_line(torchrun_module_or_script(script, nproc=nproc, args=[str(a) for a in args], timeout_s=timeout_s))
