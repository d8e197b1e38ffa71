"""Which notebooks a build runs, and with which parameters (notebooks/profiles.yaml).

    cpu:                      # the default profile; notebook defaults already target a 2-core CPU
      "*": {}
    gpu:
      "*": {device: cuda}     # every notebook
      "02": {nproc: 8}        # notebook 02 only (a full stem such as "02_ddp_scaling" works too)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from distlab import yaml_input

NOTEBOOK_RE = re.compile(r"^(\d+)_.+\.ipynb$")
DEFAULT_PROFILE = "cpu"


def discover(notebooks_dir: str | Path, only: Iterable[str] | None = None) -> list[Path]:
    """The `NN_*.ipynb` notebooks of a folder in numeric order, optionally only those selected
    by number ("01", "1") or stem ("01_single_device_baseline")."""
    notebooks_dir = Path(notebooks_dir)
    found = sorted(
        (p for p in notebooks_dir.glob("*.ipynb") if NOTEBOOK_RE.match(p.name)),
        key=lambda p: (int(NOTEBOOK_RE.match(p.name).group(1)), p.name),
    )
    if only is None:
        return found
    wanted = list(only)
    picked = [p for p in found if any(selects(w, p) for w in wanted)]
    missing = [w for w in wanted if not any(selects(w, p) for p in found)]
    if missing:
        raise ValueError(f"--only {' '.join(missing)}: no such notebook in {notebooks_dir} "
                         f"(have: {', '.join(p.stem for p in found) or 'none'})")
    return picked


def selects(key: str, nb: Path) -> bool:
    key = key.removesuffix(".ipynb")
    number = NOTEBOOK_RE.match(nb.name).group(1)
    return key == nb.stem or (key.isdigit() and int(key) == int(number))


class ProfileError(ValueError):
    """An unknown profile name (one line, exit 2 from distlab.cli.run_main)."""


def load_profiles(path: str | Path | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Read a profiles file: {profile: {"*" | "NN" | stem: {param: value}}}. A missing file is {}."""

    if path is None or not Path(path).exists():
        return {}
    data = yaml_input.load_file(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of profile names")
    for name, body in data.items():
        body = body or {}
        if not isinstance(body, dict) or not all(isinstance(v or {}, dict) for v in body.values()):
            raise ValueError(f"{path}: profile {name!r} must map '*', 'NN' or a notebook stem "
                             "to a mapping of parameters")
        data[name] = {str(k): dict(v or {}) for k, v in body.items()}
    return data


def parameters_for(profiles: dict, profile: str, notebook: str | Path) -> dict[str, Any]:
    """The parameters of one notebook under a profile: "*" first, then "NN", then the stem."""
    if profile not in profiles:
        if profile == DEFAULT_PROFILE:
            return {}  # the default profile may be left out: notebook defaults are the CPU ones
        raise ProfileError(f"unknown profile {profile!r} (have: {', '.join(profiles) or 'none'})")
    body = profiles[profile]
    stem = Path(notebook).stem
    m = NOTEBOOK_RE.match(Path(notebook).name)
    keys = ["*"]
    if m:
        keys += sorted((k for k in body if k.isdigit() and int(k) == int(m.group(1))), key=len)
    keys.append(stem)
    params: dict[str, Any] = {}
    for k in keys:
        params.update(body.get(k, {}))
    return params
