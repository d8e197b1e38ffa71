"""All-reduce bus bandwidth against the link rate of the emulated LAN (tc tbf on every host's link).

    python -m distlab.bench.lan_network [--rates 100mbit,1gbit,10gbit] [--sizes-kib 64,1024,16384,65536]

Two hosts (network namespaces), one gloo rank each, distlab.workers.allreduce_bench over a message-size
sweep per link rate. busbw = algbw x 2(n-1)/n is what each link carried, so it is compared with the
shaped rate directly: at large messages a healthy TCP path reaches >= 90% of it (goal at 1 Gbit). At
10 Gbit the emulation is bounded by the CPU copying through veth, not by the shaper: the table says so.
Without namespaces (localhost fallback) nothing is shaped: the sweep runs once, on loopback, labelled so
(rate "loopback", no fraction of a link).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distlab.cli import finite_float, run_main
from distlab.jsonio import strict_json
from distlab.lan import host_runs
from distlab.lan.hosts import LOOPBACK, link_bytes_per_s, rate_bits
from distlab.paths import BUILD_DIR


def sweep(placement: host_runs.Placement, rates: list[str], sizes_kib: list[float], seconds: float = 0.5,
          echo=False) -> list[dict]:
    """One row per (rate, size): busbw in bytes/s and as a fraction of the link's rate. On localhost one pass,
    rate "loopback": nothing was shaped, so no row carries a rate (its fraction is NaN)."""
    rows = []
    for rate in placement.link_rates(rates):
        if placement.cluster:
            placement.cluster.shape_all(rate)
        out = BUILD_DIR / "lan" / f"allreduce_{rate}.json"
        out.unlink(missing_ok=True)
        job = host_runs.run_module(placement, f"allreduce_{rate}", "distlab.workers.allreduce_bench",
                              ["--out", str(out), "--backend", "gloo", "--sizes-kib", ",".join(map(str, sizes_kib)),
                               "--seconds-per-size", str(seconds), "--min-iters", "2", "--warmup", "1"],
                              echo=echo, timeout_s=300)
        if not job.ok:
            raise RuntimeError(f"all-reduce at {rate} failed:\n{job.failure()}")
        result = json.loads(out.read_text())
        for r in result["results"]:
            busbw = r["busbw_GBps"] * 1e9
            rows.append({"rate": rate, "rate_bytes_per_s": link_bytes_per_s(rate), "size_bytes": r["size_bytes"],
                         "time_us": r["time_us"], "busbw_bytes_per_s": busbw,
                         "fraction_of_link": busbw / link_bytes_per_s(rate), "placement": placement.kind})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.bench.lan_network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100mbit,1gbit,10gbit")
    ap.add_argument("--sizes-kib", default="64,1024,16384,65536")
    ap.add_argument("--out", type=Path, default=BUILD_DIR / "lan" / "lan_network.json")
    args = ap.parse_args(argv)
    try:
        rates = [r for r in args.rates.split(",") if r]
        for r in rates:
            rate_bits(r)
        sizes = [finite_float(s) for s in args.sizes_kib.split(",") if s]
    except ValueError as e:
        print(f"python -m distlab.bench.lan_network: error: {e}", file=sys.stderr)
        return 2
    placement = host_runs.place(2, rates[0])
    with placement.running():
        print(placement.describe(), flush=True)
        rows = sweep(placement, rates, sizes)
    print(f"{'rate':>8} {'size(B)':>10} {'busbw(MB/s)':>12} {'% of link':>10}")
    for r in rows:
        share = "unshaped" if r["rate"] == LOOPBACK else f"{100 * r['fraction_of_link']:.1f}%"
        print(f"{r['rate']:>8} {r['size_bytes']:>10} {r['busbw_bytes_per_s'] / 1e6:>12.1f} {share:>10}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(strict_json(rows, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main, sigterm_exits=True)  # a SIGTERM kills the launched process groups too
