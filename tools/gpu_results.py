"""The GPU records of one lent-machine session, as the book shows them.

    python tools/gpu_results.py figures/gpu/session_2026-11-26 figures/gpu/session_2026-11-27

Each session folder holds what tools/gpu_session.sh brought back, one folder per call (call1, call2, ...),
and SESSION.json: the device's versions and the commit each call ran (a lent machine gets a copy of the
working tree, whose git metadata can be stale, so the commit is the one the caller sent). This writes,
beside the session folders:

- mfu_ladder.csv: every rung of the MFU ladder, from the latest session and call that measured it with the
  code of that call (a call's CSV if it saved one, else the rung lines of its log), with the call and commit.
  A session's SESSION.json may list "ladder_repeats": rungs it ran again with unchanged code only to reach
  the rungs after them; those stay in the sidecar, and the table keeps the measurement made in the same call
  as the rung before it, so neighbouring rungs compare side by side;
- mfu_ladder.png: MFU per rung against the data-sheet peak and against the measured matmul peak;
- trainer_vs_hf.csv: the distlab / HF Trainer / TRL comparison as each session measured it;

each with a provenance sidecar naming the device, driver, CUDA and PyTorch versions and the sources.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from distlab.bench.mfu_ladder import RUNGS  # noqa: E402
from distlab.provenance import save_figure, save_table  # noqa: E402

RUNG_LINE = re.compile(r"^(?P<change>\S.*?)\s+(?P<tps>\d+) tokens/s\s+MFU (?P<mfu>[\d.]+)% \(data sheet\), "
                       r"(?P<mfu_measured>[\d.]+)% \(measured peak\), (?P<mem>[\d.]+) GiB$")
PEAK_LINE = re.compile(r"^matmul peak measured here: (?P<peak>[\d.]+) TFLOP/s")


# The ladder the 2026-11-26/27 sessions ran (commits before the GPU-ready step): their logs name these rungs.
LADDER_2026_11 = ("baseline: eager attention, padded rows, micro-batch 2", "+ fused AdamW", "+ SDPA attention",
                  "+ micro-batch 8", "+ packing, per-document flash attention",
                  "+ activation checkpointing, micro-batch 16", "+ torch.compile, block by block",
                  "- activation checkpointing (memory allows it)", "+ bf16 weights, no autocast")


def ladder_rows(call: Path, commit: str) -> list[dict]:
    """A call's rungs: its saved CSV where there is one, else the rung lines its log printed."""
    current = [name for name, _ in RUNGS]
    names = current if any(name in (call / "mfu_ladder.log").read_text() for name in current[5:]) else LADDER_2026_11
    log = (call / "mfu_ladder.log").read_text()
    peak = next(float(m["peak"]) for m in map(PEAK_LINE.match, log.splitlines()) if m)
    if (call / "mfu_ladder.csv").exists():
        table = pd.read_csv(call / "mfu_ladder.csv")
        rows = [{"rung": int(r.rung), "change": r.change, "tokens_per_s": r.tokens_per_s,
                 "mfu_data_sheet": r.mfu_data_sheet, "mfu_measured_peak": r.mfu_measured_peak,
                 "peak_mem_gib": r.peak_mem_gib} for r in table.itertuples() if pd.notna(r.tokens_per_s)]
    else:
        rows = []
        for line in log.splitlines():
            m = RUNG_LINE.match(line.strip())
            if m and m["change"] in names:
                rows.append({"rung": names.index(m["change"]), "change": m["change"], "tokens_per_s": float(m["tps"]),
                             "mfu_data_sheet": float(m["mfu"]) / 100,
                             "mfu_measured_peak": float(m["mfu_measured"]) / 100, "peak_mem_gib": float(m["mem"])})
    for row in rows:
        row.update(call=call.name, commit=commit, measured_matmul_tflops=peak)
    return rows


TRAINER_LINE = re.compile(r"^round \d+/\d+\s+(?P<framework>\S+):\s+(?P<tps>\d+) real tokens/s$")


def trainer_rows(record: Path) -> pd.DataFrame:
    """A session's distlab / HF Trainer / TRL record: its CSV, or the round lines of its log where the
    comparison was cut off before it saved one (ratios then against the HF Trainer row it did measure)."""
    if record.suffix == ".csv":
        return pd.read_csv(record)[["framework", "tokens_per_s", "vs_hf_trainer"]]
    rows = [{"framework": m["framework"], "tokens_per_s": float(m["tps"])}
            for m in map(TRAINER_LINE.match, record.read_text().splitlines()) if m]
    table = pd.DataFrame(rows)
    table["vs_hf_trainer"] = table["tokens_per_s"] / table.set_index("framework").loc["hf_trainer", "tokens_per_s"]
    return table


def main(sessions: list[Path]) -> int:
    out = sessions[0].parent
    metas = {session.name: json.loads((session / "SESSION.json").read_text()) for session in sessions}
    # keyed by (rung, change): a later ladder that puts another change at the same rung is a row of its own
    by_rung: dict[tuple[int, str], dict] = {}
    superseded, repeats, sources = [], [], []
    for session in sorted(sessions):  # a later call's measurement of a rung replaces an earlier one (newer code)
        meta = metas[session.name]
        calls = sorted(p for p in session.iterdir() if p.is_dir() and (p / "mfu_ladder.log").exists())
        for call in calls:
            sources.append(str(call.relative_to(out)))
            for row in ladder_rows(call, meta["calls"][call.name]["commit"]):
                row["call"] = f"{meta['date']} {call.name}"
                if row["rung"] in meta.get("ladder_repeats", []):  # same code again, away from its neighbours
                    repeats.append(row)
                    continue
                key = (row["rung"], row["change"])
                if key in by_rung:
                    superseded.append({**by_rung[key], "superseded_by": row["call"]})
                by_rung[key] = row
    ladder = pd.DataFrame([by_rung[k] for k in sorted(by_rung)])
    first = metas[sorted(metas)[0]]
    versions = {k: sorted({m[k] for m in metas.values()}) for k in ("device", "driver", "cuda", "torch")}
    base = {**{k: " / ".join(v) for k, v in versions.items()}, "model": "qwen2.5-0.5b-random", "world_size": 1,
            "commit": " / ".join(f"{m['date']} {c}: {v['commit']}"
                                 for m in metas.values() for c, v in m["calls"].items()),
            "date": " / ".join(m["date"] for m in metas.values()), "packages": first["packages"],
            "session": " ".join(sorted(metas))}
    used = ladder.drop_duplicates("call")  # the calls whose rows the table shows name its commits and dates
    provenance = {**base, "commit": " / ".join(f"{r.call}: {r.commit}" for r in used.itertuples()),
                  "date": " / ".join(sorted({r.call.split()[0] for r in used.itertuples()})), "sources": sources,
                  "superseded_rows": superseded, "repeated_rows": repeats,
                  "note": " ".join(f"{m['date']}: {m.get('note', '')}" for m in metas.values())}
    save_table(ladder.round(4), out / "mfu_ladder.csv", provenance)

    fig, ax = plt.subplots(figsize=(9, 4.2))
    y = range(len(ladder))
    ax.barh([i - 0.2 for i in y], ladder["mfu_data_sheet"] * 100, height=0.4, color="tab:blue",
            label="MFU against the data-sheet peak (989 TFLOP/s)")
    ax.barh([i + 0.2 for i in y], ladder["mfu_measured_peak"] * 100, height=0.4, color="tab:orange",
            label="MFU against the matmul peak measured in the same call ("
                  + ", ".join(f"{p:.0f}" for p in ladder["measured_matmul_tflops"].unique()) + " TFLOP/s)")
    for i, row in enumerate(ladder.itertuples()):
        ax.text(row.mfu_measured_peak * 100 + 0.4, i, f"{row.tokens_per_s / 1000:.1f}k tokens/s", va="center",
                fontsize=8)
    ax.set_yticks(list(y), [f"{r.change} ({r.call})" for r in ladder.itertuples()], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("model FLOPs utilisation (%)")
    ax.set_xlim(0, max(30, ladder["mfu_measured_peak"].max() * 100 * 1.35))
    ax.set_title("Full fine-tuning of a 0.5B Qwen2 shape on one H100, one change per rung", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.35, -0.14), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "mfu_ladder.png", provenance)

    tables, trainer_sources = [], []
    for session in sorted(sessions):
        meta = metas[session.name]
        record = session / meta["trainer_vs_hf"]
        table = trainer_rows(record)
        call = record.parent.name
        table.insert(0, "measured", f"{meta['date']} {call} ({meta['calls'][call]['commit']})")
        tables.append(table)
        trainer_sources.append(str(record.relative_to(out)))
    trainer = pd.concat(tables, ignore_index=True)
    save_table(trainer.round(4), out / "trainer_vs_hf.csv",
               {**base, "sources": trainer_sources,
                "note": " ".join(f"{m['date']}: {m.get('trainer_note', '')}" for m in metas.values())})
    print(ladder.to_string(index=False))
    print(trainer.to_string(index=False))
    print(f"wrote {out / 'mfu_ladder.csv'}, {out / 'mfu_ladder.png'}, {out / 'trainer_vs_hf.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main([Path(a) for a in sys.argv[1:]]))
