"""python -m distlab.lan up|down|status|reap (see distlab.lan.hosts)."""

from __future__ import annotations

import argparse
import sys

from distlab.cli import run_main
from distlab.jsonio import strict_json
from distlab.lan import hosts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.lan", description="the emulated LAN cluster")
    ap.add_argument("action", choices=["up", "down", "status", "reap"])
    ap.add_argument("--rates", default="1gbit,1gbit,1gbit", help="one link rate per host, e.g. 1gbit,100mbit")
    args = ap.parse_args(argv)
    if args.action == "reap":
        hosts.reap()
        return 0
    if args.action == "down":
        removed = hosts.down()
        print(f"removed: {', '.join(removed) if removed else 'nothing (already down)'}")
        return 0
    try:
        cluster = hosts.Cluster.from_rates([r.strip() for r in args.rates.split(",") if r.strip()])
    except ValueError as e:
        print(f"error: --rates: {e}", file=sys.stderr)
        return 2
    if args.action == "up":
        ok, why = hosts.available()
        if not ok:
            print(f"error: cannot build the namespace cluster: {why}", file=sys.stderr)
            return 1
        cluster.up()
    for row in cluster.status():
        print(strict_json(row))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
