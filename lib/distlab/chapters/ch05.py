"""Chapter 05 (a heterogeneous LAN): what the emulated cluster needs and which mode ran, the even and the
balanced split drawn, the all-reduce and DDP-over-the-link figures (on loopback, labelled so, in the localhost
fallback), the balance runs on two and three hosts with their theory, which timing claims this machine can
check (a core per rank; faster in every one of the alternating rounds), and the link-cut demo."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Rectangle

from distlab.batching import ideal_step_ratio, rows_per_rank, shares_from_throughput
from distlab.bench import lan_balance
from distlab.lan import diagnose, host_runs, hosts
from distlab.lan.cgroups import HostLimits
from distlab.lan.cgroups import supported as cgroups_supported
from distlab.machine import Machine, Sections
from distlab.provenance import save_figure

# ---------------------------------------------------------------- prerequisites and the mode that ran


def prerequisites(here: Machine) -> pd.DataFrame:
    """What the emulated cluster needs, what each part is for, and whether this machine (distlab.machine's
    description of it) has it."""
    cgroup_v1, why_not = cgroups_supported()
    rows = [
        ("Linux", f"network namespaces and cgroups are Linux features (this is {here.system})",
         here.system == "Linux"),
        ("root (CAP_NET_ADMIN)", "network namespaces, veth links, cgroups", here.root),
        ("`ip` and `tc` (iproute2)", "the hosts (`ip netns`, a bridge, veth pairs) and their link rates "
         "(a `tbf` shaper per link)", here.network_tools),
        ("cgroup v1 `cpu` and `memory` hierarchies", "cpu_mode='quota' and the memory-cap demo"
         + ("" if cgroup_v1 else f" ({why_not})"), cgroup_v1),
        ("cgroup v2 (unified)", "not used: distlab writes v1 files; cpu_mode='sleep' needs no cgroup",
         Path("/sys/fs/cgroup/cgroup.controllers").exists() or Path("/sys/fs/cgroup/unified").exists()),
    ]
    return pd.DataFrame(rows, columns=["prerequisite", "needed for", "present here"])


def cluster_section(sections: Sections, title: str, placement: host_runs.Placement, *more: str | None) -> bool:
    """Whether a section that needs the namespace cluster runs: False, with ONE printed line, when this machine
    cannot build it (distlab.machine), when building it failed here (`placement.why_local`), or for the first
    reason in `more` that is not None (a section's own needs: writable cgroups, a parameter)."""
    lacking = sections.machine.missing("netns")
    if lacking is None and placement.cluster is None:
        lacking = f"the namespace cluster, which failed here: {placement.why_local}"
    lacking = lacking or next((m for m in more if m), None)
    if lacking:
        sections.skip(title, f"needs {lacking}")
        return False
    return sections.run(title)


# ---------------------------------------------------------------- timing claims: which this machine can check


def faster_in_every_round(claim: str, ranks: int, slower_rounds: Sequence[float], faster_rounds: Sequence[float],
                          sections: Sections) -> dict[str, Any]:
    """A claim that one setup is faster than another, from alternating rounds of both. Its margin is the spread
    of those rounds, the noise of this machine in this run: it holds when even the slowest round of the faster
    setup beats the fastest round of the slower one (their min-max ranges do not overlap), so no pairing of
    rounds says otherwise. Checked only with a core per rank (Machine.timing_skip); otherwise the row says
    why, and `sections` prints one line and lists it."""
    why = sections.machine.timing_skip(ranks)
    sections.claim(claim, why)
    return {"claim": claim, "ranks": ranks, "rounds": min(len(slower_rounds), len(faster_rounds)),
            "slower: median (s)": statistics.median(slower_rounds), "slower: fastest round (s)": min(slower_rounds),
            "faster: median (s)": statistics.median(faster_rounds), "faster: slowest round (s)": max(faster_rounds),
            "holds": max(faster_rounds) < min(slower_rounds), "checked": why is None, "why not checked": why or ""}


def balance_claims(results: Mapping[str, Mapping[str, Any]], sections: Sections) -> pd.DataFrame:
    """Per cluster: balanced faster than naive in every round (one core per host), beside the ratio the
    calibration's speeds predicted; for the three hosts also the split by speed faster than host 0 alone in
    every round."""
    rows = [{**faster_in_every_round(f"{name}: balanced step shorter than naive", len(r["quotas"]),
                                  r["naive_step_s_rounds"], r["balanced_step_s_rounds"], sections),
             "predicted by the calibration": r["predicted_ratio"]} for name, r in results.items()]
    name, three = list(results.items())[-1]
    if "one_host" in three:  # host 0 alone is one run (no rounds): every balanced round must beat it
        rounds = three["balanced_step_s_rounds"]
        alone_s = three["one_host"]["step_time_s"] * three["global_rows"] / three["one_host"]["rows"]  # same rows
        rows.append(faster_in_every_round(f"{name}: split by speed faster than host 0 alone (same rows per step)",
                                       len(three["quotas"]), [alone_s], rounds, sections))
    return pd.DataFrame(rows).set_index("claim").round(4)


def pipeline_claims(race: Mapping[str, Any], sections: Sections) -> pd.DataFrame:
    """The measured split's step shorter than the equal split's in every round (two hosts, a core each)."""
    return pd.DataFrame([faster_in_every_round("2 hosts: measured split's step shorter than the equal split's", 2,
                                            race["equal_step_s_rounds"], race["measured_step_s_rounds"],
                                            sections)
                         ]).set_index("claim").round(4)


# ---------------------------------------------------------------- the idea, drawn


def draw_even_vs_balanced(speeds: Sequence[float], global_rows: int, path: str | Path, provenance: dict) -> Path:
    """One optimizer step on hosts of the given relative speeds: the even split (every host the same rows,
    the fast one waits) against the split by speed (every host finishes together), then the all-reduce."""
    world = len(speeds)
    splits = {"even split": rows_per_rank(global_rows, [1] * world, world),
              "split by speed": rows_per_rank(global_rows, shares_from_throughput(speeds), world)}
    ends = {k: max(n / s for n, s in zip(v, speeds)) for k, v in splits.items()}
    allreduce = 0.12 * max(ends.values())  # drawn, not measured: the same bytes in both splits
    horizon = max(ends.values()) + allreduce
    fig, axes = plt.subplots(2, 1, figsize=(8.5, 1.1 + 0.75 * world * 2), sharex=True)
    for ax, (title, split) in zip(axes, splits.items()):
        end = ends[title]
        for r, (rows, speed) in enumerate(zip(split, speeds)):
            y = world - 1 - r
            busy = rows / speed
            ax.add_patch(Rectangle((0, y), busy, 0.7, fc=f"C{r}", alpha=0.6, ec="k"))
            ax.text(busy / 2, y + 0.35, f"{rows} rows", ha="center", va="center", fontsize=8)
            if end - busy > 1e-9:
                ax.add_patch(Rectangle((busy, y), end - busy, 0.7, fc="none", ec="0.5", hatch="//"))
                ax.text((busy + end) / 2, y + 0.35, "waits", ha="center", va="center", fontsize=8, color="0.3")
            ax.add_patch(Rectangle((end, y), allreduce, 0.7, fc="C3", alpha=0.35, ec="C3"))
        ax.axvline(end + allreduce, color="k", lw=1, ls="--")
        ax.text(end + allreduce, world - 0.05, f" step ends: {end:.0f} + all-reduce", fontsize=8, va="top")
        ax.set_yticks([world - 1 - r + 0.35 for r in range(world)],
                      [f"host {r} (speed {s:g})" for r, s in enumerate(speeds)])
        ax.set_ylim(-0.2, world)
        ax.set_title(f"{title}: {' / '.join(map(str, split))} of {global_rows} rows", fontsize=10)
    axes[-1].set_xlim(0, horizon * 1.35)
    axes[-1].set_xlabel("time in one step (units: one row on a speed-1 host); red: the all-reduce")
    ratio = ends["split by speed"] / ends["even split"]
    fig.suptitle(f"compute per step: {ends['split by speed']:.0f} / {ends['even split']:.0f} = {ratio:.2f} "
                 f"(world x slowest / sum of speeds = {ideal_step_ratio(speeds):.2f})", fontsize=10)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the network, and DDP over it


def allreduce_figure(net: pd.DataFrame, path: str | Path, provenance: dict) -> Path:
    """Bus bandwidth against the message size: as a share of each shaped rate on the namespace cluster; on the
    localhost fallback in MB/s, one line labelled loopback, not shaped (there is no rate to take a share of)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    shaped = (net.rate != hosts.LOOPBACK).all()
    for rate, g in net.groupby("rate", sort=False):
        y = 100 * g.fraction_of_link if shaped else g.busbw_bytes_per_s / 1e6
        ax.plot(g.size_bytes / 2**20, y, marker="o", label=rate if shaped else "loopback, not shaped")
    ax.set_xscale("log")
    ax.set_xlabel("message size (MiB)")
    if shaped:
        ax.set_ylabel("bus bandwidth (% of link rate)")
        ax.axhline(90, color="grey", ls=":", lw=1)
        ax.legend(title="tbf rate")
        ax.set_title("gloo all-reduce, 3 emulated hosts")
    else:
        ax.set_ylabel("bus bandwidth (MB/s)")
        ax.legend()
        ax.set_title("gloo all-reduce, 3 agents on localhost: loopback, no link rate applied")
    out = save_figure(fig, path, provenance)
    plt.show()
    plt.close(fig)
    return out


def ddp_tables(sweep_rows: Sequence[dict], hook_rows: Sequence[dict]) -> tuple[pd.DataFrame, ...]:
    """(the link sweep, the comm-hook runs, both as one table with the loss curves as text for the csv)."""
    sweep_df, hooks_df = pd.DataFrame(sweep_rows), pd.DataFrame(hook_rows)
    table = pd.concat([sweep_df.assign(experiment="link sweep", hook="none"),
                       hooks_df.assign(experiment="comm hook")], ignore_index=True).drop(columns=["steps"])
    table["losses"] = table.losses.map(lambda v: ";".join(f"{x:.5f}" for x in v))
    return sweep_df, hooks_df, table


def ddp_figure(sweep_df: pd.DataFrame, hooks_df: pd.DataFrame, path: str | Path, provenance: dict) -> Path:
    """Left: step time split into compute and communication per link rate, LoRA beside full fine-tuning;
    right: full fine-tuning's loss per step under each DDP comm hook, at the rate the hooks ran at (loopback,
    labelled so, in the localhost fallback)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    order = sorted(sweep_df.rate.unique(), key=hosts.link_bits)
    shaped = hosts.LOOPBACK not in order
    for j, (kind, colour) in enumerate((("lora", "tab:blue"), ("full", "tab:orange"))):
        g = sweep_df[sweep_df["mode"] == kind].set_index("rate").loc[order]
        x = [i + (j - 0.5) * 0.38 for i in range(len(order))]
        left.bar(x, g.compute_time_s, 0.36, color=colour, alpha=0.4, label=f"{kind}: compute")
        left.bar(x, g.comm_time_s, 0.36, bottom=g.compute_time_s, color=colour, label=f"{kind}: communication")
        for xi, step_s, share in zip(x, g.step_time_s, g.comm_share):
            left.text(xi, step_s, f"{100 * share:.0f}%", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(order)), order if shaped else ["loopback, not shaped"])
    left.set_xlabel(("tbf link rate" if shaped else "no link rate applied (localhost fallback)")
                    + " (labels: communication share of the step)")
    left.set_ylabel("step time (s)")
    left.set_title(f"DDP on 2 {'emulated hosts' if shaped else 'agents on localhost'}: LoRA vs full fine-tuning")
    left.legend(fontsize=8)
    for row, style in zip(hooks_df.itertuples(), ["-o", "--s", ":^", "-.v"]):  # fp16 lies on top of none
        right.plot(row.steps, row.losses, style, markersize=7, fillstyle="none",
                   label=f"{row.hook}: {row.step_time_s:.2f} s/step, {row.comm_bytes / 1e6:.2f} MB/step")
    right.set_xticks(hooks_df.steps.iloc[0])
    right.set_xlabel("optimizer step")
    right.set_ylabel("training loss")
    hook_rate = hooks_df.rate.iloc[0]
    where = f"at {hook_rate}" if hook_rate != hosts.LOOPBACK else "on loopback, not shaped"
    right.set_title(f"full fine-tuning {where}: DDP comm hooks")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    plt.close(fig)
    return out


def at_slowest_link(sweep_df: pd.DataFrame) -> pd.DataFrame:
    """The link sweep's rows at its slowest rate (the one loopback run on localhost), one per mode."""
    return sweep_df[sweep_df.rate == min(sweep_df.rate.unique(), key=hosts.link_bits)].set_index("mode")


def ddp_summary(sweep_df: pd.DataFrame, hooks_df: pd.DataFrame) -> pd.DataFrame:
    """At the slowest link: bytes per step (measured and planned) and communication share, LoRA against full;
    then each comm hook against none."""
    slowest = min(sweep_df.rate.unique(), key=hosts.link_bits)
    rows = [{"run": f"{r.mode} at {slowest}", "MB per step": r.comm_bytes / 1e6,
             "planned MB": r.predicted_grad_bytes / 1e6, "comm share": r.comm_share, "step s": r.step_time_s,
             "final loss": r.losses[-1]} for r in sweep_df[sweep_df.rate == slowest].itertuples()]
    rows += [{"run": f"full, hook {r.hook}", "MB per step": r.comm_bytes / 1e6, "planned MB": float("nan"),
              "comm share": r.comm_share, "step s": r.step_time_s, "final loss": r.losses[-1]}
             for r in hooks_df.itertuples()]
    return pd.DataFrame(rows).set_index("run").round(4)


# ---------------------------------------------------------------- the slow device, balanced


def balance_runs(placement: host_runs.Placement, quotas_two: Sequence[float], quotas_three: Sequence[float], *,
                 micro: int, steps: int, rounds: int, three_steps: int, cpu_mode: str,
                 timeout_s: int) -> dict[str, Any]:
    """One calibration on the three hosts (each host's rows/s under its CPU share), then naive against
    balanced on the first two hosts and on all three (one launch each), and host 0's loop alone (in this process)."""
    limits = [HostLimits(cpu=q, cpu_mode=cpu_mode) for q in quotas_three]
    calib = lan_balance.calibrate(placement, limits, lan_balance.SMALL, rows=micro, global_rows=micro * 3)
    same_first_two = list(quotas_two) == list(quotas_three[:2])
    two = lan_balance.compare(placement.subset(2), list(quotas_two), micro=micro, steps=steps, rounds=rounds,
                              name="nb05_two", cpu_mode=cpu_mode, timeout_s=timeout_s,
                              rows_per_s=calib["rows_per_s"][:2] if same_first_two else None)
    three = lan_balance.compare(placement, list(quotas_three), micro=micro, steps=three_steps, rounds=rounds,
                                name="nb05_three", cpu_mode=cpu_mode, timeout_s=timeout_s,
                                rows_per_s=calib["rows_per_s"])
    alone = lan_balance.one_host(micro * len(quotas_three), steps=three_steps, name="nb05_one")
    three["one_host"], three["speedups"] = alone, lan_balance.speedups(three, alone)
    return {"2 hosts, 100/50%": two, "3 hosts, 100/50/50%": three}


def curve_difference(r: Mapping[str, Any]) -> float:
    """Largest difference between the naive and the balanced run's loss or gradient norm, step by step."""
    return max(abs(a - b) for key in ("loss", "grad_norm")
               for a, b in zip(r["naive_curves"][key], r["balanced_curves"][key]))


def balance_table(results: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{"setup": k, "measured speeds (rows/s)": [round(x, 1) for x in r["rows_per_s"]],
                          "naive rows": r["naive_split"], "balanced rows": r["balanced_split"],
                          "naive step s": r["naive_step_s"], "balanced step s": r["balanced_step_s"],
                          "balanced / naive": r["ratio"], "theory": r["theory_ratio"],
                          "from measured speeds": r["predicted_ratio"],
                          "with fixed costs": r["predicted_ratio_with_fixed"], "fixed s": r["fixed_s"],
                          "max |loss or grad-norm diff|": curve_difference(r)}
                         for k, r in results.items()]).set_index("setup").round(4)


def speedup_table(three: Mapping[str, Any]) -> pd.DataFrame:
    """The three-host cluster's throughput over its fast host alone, measured and from the speeds."""
    alone = three["one_host"]["tokens_per_s"]
    return pd.DataFrame([{"split": kind, "tokens/s": three[f"{key}_tokens_per_s"], "host 0 alone tokens/s": alone,
                          "speedup": three["speedups"][kind], "theory": three["ideal_speedups"][kind]}
                         for kind, key in (("even", "naive"), ("balanced", "balanced"))]).set_index("split").round(3)


def balance_figure(results: Mapping[str, Mapping[str, Any]], path: str | Path, provenance: dict) -> Path:
    """Left: step times (median bar, min-max whisker); middle: balanced / naive against its theory line;
    right: the three-host speedup over host 0 alone against the ideal (the sum of the speeds)."""
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    names = list(results)
    ticks = [name.replace(", ", ",\n") for name in names]  # "3 hosts,\n100/50/50%": two lines fit a narrow panel
    for offset, kind, label in ((-0.2, "naive", "naive (equal rows)"), (0.2, "balanced", "balanced (by speed)")):
        med = [results[k][f"{kind}_step_s"] for k in names]
        rounds = [results[k][f"{kind}_step_s_rounds"] for k in names]
        spread = [[m - min(v) for m, v in zip(med, rounds)], [max(v) - m for m, v in zip(med, rounds)]]
        left.bar([i + offset for i in range(len(names))], med, 0.36, yerr=spread, capsize=4, label=label)
    left.set_xticks(range(len(names)), ticks)
    left.set_ylabel("step time (s)")
    left.set_title("median step time over the rounds (whiskers: min-max)", fontsize=10)
    left.set_ylim(0, left.get_ylim()[1] * 1.25)  # headroom above the bars for the legend
    left.legend(fontsize=8, loc="upper left", ncols=2)
    for i, k in enumerate(names):
        mid.bar(i, results[k]["ratio"], 0.5, color="C2", alpha=0.7, label="measured" if i == 0 else None)
        theory = results[k]["theory_ratio"]
        mid.hlines(theory, i - 0.35, i + 0.35, color="k", lw=2, label="theory" if i == 0 else None)
        mid.text(i + 0.37, theory, f"{theory:.3f}", va="center", fontsize=8)
        mid.text(i, results[k]["ratio"] / 2, f"{results[k]['ratio']:.3f}", ha="center", fontsize=8)
    mid.set_xticks(range(len(names)), ticks)
    mid.set_xlim(-0.5, len(names) - 0.1)  # room right of the last bar for its theory label
    mid.set_ylim(0, 1.1)
    mid.set_ylabel("balanced / naive step time")
    mid.set_title("theory: world x slowest speed / sum of speeds", fontsize=10)
    mid.legend(fontsize=8, loc="upper left")
    three = results[names[-1]]
    kinds = ["even", "balanced"]
    right.bar(range(2), [three["speedups"][k] for k in kinds], 0.5, color=["C0", "C1"], alpha=0.8)
    for i, k in enumerate(kinds):
        right.hlines(three["ideal_speedups"][k], i - 0.35, i + 0.35, color="k", lw=2)
        right.text(i, three["speedups"][k] / 2, f"{three['speedups'][k]:.2f}x", ha="center", fontsize=8)
        right.text(i + 0.37, three["ideal_speedups"][k], f"{three['ideal_speedups'][k]:.2f}x", va="center",
                   fontsize=8)
    right.set_xlim(-0.5, 1.9)  # room right of the second bar for its theory label
    right.axhline(1, color="grey", ls=":", lw=1)
    right.set_xticks(range(2), ["even split", "split by speed"])
    right.set_ylabel("tokens/s over host 0 alone")
    right.set_title(f"{names[-1]}: speedup (black: theory;\nthe sum of the speeds for the split by speed)",
                    fontsize=10)
    fig.tight_layout()
    out = save_figure(fig, path, provenance)
    plt.show()
    plt.close(fig)
    return out


# ---------------------------------------------------------------- pipeline stages sized to the hosts


def split_candidates(plan: Mapping[str, Any]) -> pd.DataFrame:
    """Each candidate split of the layers: the stages' measured time per micro-batch and planned bytes."""
    return pd.DataFrame([{"stage layers": r["stage_layers"],
                          "ms per micro-batch": [round(1e3 * x, 1) for x in r["stage_s"]],
                          "planned MiB": [round(b / 2**20, 1) for b in r["planned_bytes"]]}
                         for r in plan["candidates"]])


def split_summary(plan: Mapping[str, Any], race: Mapping[str, Any]) -> pd.Series:
    """The equal split against the measured one: the slow host's layers, step times, ratio and prediction."""
    return pd.Series({"layers": plan["layers"], "slow host's layers, equal split": plan["equal_split"][1],
                      "slow host's layers, measured split": plan["measured_split"][1],
                      "step s, equal split": round(race["equal_step_s"], 3),
                      "step s, measured split": round(race["measured_step_s"], 3),
                      "measured / equal": round(race["ratio"], 3),
                      "predicted from layer times": round(race["predicted_ratio"], 3)}, dtype=object)


# ---------------------------------------------------------------- failures


CUT_TRAIN = {"strategy": "ddp", "eval_file": None, "save_model": False, "logging_steps": 1, "seq_len": 128,
             "micro_batch_size": 2, "eval_at_start": False, "eval_at_end": False}


def cut_link_demo(pair: host_runs.Placement, cut_timeout_s: int, timeout_s: int, at_step: int = 3) -> dict[str, Any]:
    """Train on two hosts and pull host 1's cable (`ip link set eth0 down`) once step `at_step` is logged:
    how long until the job fails, and with which message. Rebuilds the LAN afterwards."""
    log = host_runs.RUNS_DIR / "lan" / "nb05_cut" / "train_log.jsonl"
    cut: dict[str, float] = {}

    def unplug():
        cut["at"] = time.monotonic()
        if pair.cluster:
            pair.cluster.cut_link(1)

    t0 = time.monotonic()
    job = host_runs.run_training(pair, "nb05_cut", {**CUT_TRAIN, "max_steps": 400,
                                                    "collective_timeout_s": cut_timeout_s},
                                 echo=False, timeout_s=timeout_s, on_start=host_runs.when_step(log, at_step, unplug))
    ended = t0 + max(r.elapsed_s for r in job.results)
    if pair.cluster:
        pair.cluster.up()  # a fresh cable: rebuild the LAN for what follows
    return {"job": job, "cut_s": ended - cut["at"] if "at" in cut else float("nan"),
            "message": diagnose.first_error(job.lines), "timed_out": any(r.timed_out for r in job.results)}
