"""python -m distlab.slurm up|down|status: the one-machine cluster of chapter 06."""

from __future__ import annotations

import argparse

from distlab.jsonio import strict_json
from distlab.slurm.cluster import Cluster, ClusterError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.slurm", description=__doc__)
    ap.add_argument("command", choices=["up", "down", "status"])
    args = ap.parse_args(argv)
    cluster = Cluster()
    try:
        if args.command == "up":
            cluster.up()
            print(f"cluster up: export SLURM_CONF={cluster.conf}")
            print(cluster.sinfo())
        elif args.command == "down":
            stopped = cluster.down()
            print(f"cluster down: stopped {len(stopped)} process(es), nothing left running")
        else:
            print(strict_json(cluster.status(), indent=1))
    except ClusterError as e:
        print(f"distlab.slurm {args.command}: {e}")
        return 1
    return 0
