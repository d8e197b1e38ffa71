"""Provenance: every figure, table and run records device, model, world size, commit and date."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from distlab import markdown
from distlab.jsonio import strict_json
from distlab.paths import REPO_ROOT

# The packages whose versions a run records. Read from package metadata only: importing deepspeed
# costs seconds (and may JIT-build), and this module must stay cheap to import.
PACKAGES = ("torch", "transformers", "peft", "accelerate", "deepspeed", "tokenizers")


# What the book build writes (tracked, regenerated): a change there is an output, not a changed input,
# so it does not make the tree dirty. Everything else tracked (code, notebooks, data, config) does.
OUTPUT_PATHS = ("figures",)


def run_git(root: str | Path, *args: str, timeout: float = 10, check: bool = False,
            text: bool = True) -> subprocess.CompletedProcess:
    """`git -C root ARGS...`, read-only: never taking the repository's index lock.

    `git status` refreshes the index's cached file stats and writes it back under .git/index.lock, an
    optional lock: taken while a training rank stamps its provenance, it makes the user's own `git commit`
    or `git add` at that moment fail with "index.lock: File exists". --no-optional-locks (git >= 2.15)
    skips that write and passes GIT_OPTIONAL_LOCKS=0 on to any git it starts. Every git the library runs
    goes through here."""
    return subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args],
                          capture_output=True, text=text, timeout=timeout, check=check)


def git_commit(short: bool = True, root: str | Path = REPO_ROOT) -> str:
    """The commit of the working tree, with '+dirty' when an input (any tracked file outside
    OUTPUT_PATHS) has uncommitted changes."""
    try:
        rev = run_git(root, "rev-parse", "--short" if short else "--verify", "HEAD", check=True).stdout.strip()
        outputs = [f":(exclude){path}" for path in OUTPUT_PATHS]
        dirty = run_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *outputs).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    """Python's version and each of PACKAGES' ("not installed" when absent)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def cpuinfo_field(key: str) -> str | None:
    """The value of the first `key` line of /proc/cpuinfo ("model name", "flags"); None where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith(key)), None)
    return line.partition(":")[2].strip() if line is not None else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows where that is missing."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def device_description() -> str:
    """A short human name of the compute device: GPU model(s), or the CPU model and core count."""
    import torch  # deferred: torch costs seconds to import; git_commit and save_table users (regenerate) need none

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"{torch.cuda.device_count()}x " + " / ".join(sorted(names))
    return f"CPU {cpu_model()} ({os.cpu_count()} cores)"


def stamp(model: str, world_size: int | str, device: str | None = None, **extra: Any) -> dict[str, Any]:
    """The provenance record attached to a figure or table."""
    rec = {
        "device": device or device_description(),
        "model": model,
        "world_size": world_size,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    # Set by python -m distlab.publish.regenerate: which chapter under which profile drew this, from
    # which inputs (distlab.publish.freshness), so a committed output can be checked against the tree.
    for key, var in (("chapter", "DISTLAB_CHAPTER"), ("profile", "DISTLAB_PROFILE"), ("inputs", "DISTLAB_INPUTS")):
        if os.environ.get(var):
            rec[key] = os.environ[var]
    rec.update(_accelerator_versions())
    rec.update(extra)
    return rec


def _accelerator_versions() -> dict[str, str]:
    """On a CUDA machine, the versions a GPU number depends on: PyTorch, its CUDA and the driver.
    Only where torch is already imported (this module stays torch-free for the planners)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    rec = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=True)
        rec["driver"] = query.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        rec["driver"] = "unknown (nvidia-smi did not answer)"
    return rec


def stamp_text(rec: dict[str, Any]) -> str:
    return (f"{rec['device']} | model {rec['model']} | world size {rec['world_size']} | "
            f"commit {rec['commit']} | {rec['date']}")


def save_figure(fig, path: str | Path, provenance: dict[str, Any]) -> Path:
    """Save a matplotlib figure with its provenance printed under it and in a sidecar JSON.

    The stamp goes below everything the figure has drawn (axis labels, tick labels, legends
    outside the axes), so it can never cover any of it; the tight bounding box then grows to hold it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    drawn = fig.get_tightbbox()  # inches, after layout (works for pyplot figures and bare Figure() alike)
    width, height = fig.get_size_inches()
    fig.text(drawn.x0 / width, drawn.y0 / height - 0.01, stamp_text(provenance), fontsize=6, color="0.4",
             ha="left", va="top")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    write_sidecar(path, provenance)
    return path


def save_table(df, path: str | Path, provenance: dict[str, Any]) -> Path:
    """Save a pandas table as CSV (or Markdown for .md) with a provenance sidecar JSON.

    The Markdown form also carries the provenance as a trailing line, so a reader of the
    table alone still sees where the numbers came from."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".md":
        path.write_text(markdown.table(df, floatfmt="g") + f"\n\n_Provenance: {stamp_text(provenance)}_\n")
    else:
        df.to_csv(path, index=False)
    write_sidecar(path, provenance)
    return path


def write_sidecar(path: Path, provenance: dict[str, Any]) -> Path:
    side = path.with_name(path.name + ".provenance.json")
    side.write_text(strict_json(provenance, indent=2, sort_keys=True) + "\n")
    return side
