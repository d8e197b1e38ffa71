"""python -m distlab.publish.regenerate, no kernel needed: the profiles (merged by star, number and stem; the repo's
file valid) and the notebooks' order. Failure reporting and no orphaned processes, with real kernels:
tests/notebooks/test_regenerate_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distlab.publish import regenerate

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- no kernel needed


def test_profiles_merge_star_number_and_stem(tmp_path):
    f = tmp_path / "profiles.yaml"
    f.write_text('gpu:\n  "*": {device: cuda, max_steps: 100}\n  "02": {max_steps: 7}\n'
                 '  02_ddp_scaling: {nproc: 4}\ncpu:\n')
    profiles = regenerate.load_profiles(f)
    assert regenerate.parameters_for(profiles, "gpu", "02_ddp_scaling.ipynb") == {
        "device": "cuda", "max_steps": 7, "nproc": 4}
    assert regenerate.parameters_for(profiles, "gpu", "01_x.ipynb") == {"device": "cuda", "max_steps": 100}
    assert regenerate.parameters_for(profiles, "cpu", "01_x.ipynb") == {}
    with pytest.raises(ValueError, match="unknown profile .tpu."):
        regenerate.parameters_for(profiles, "tpu", "01_x.ipynb")


def test_repo_profiles_file_is_valid():
    profiles = regenerate.load_profiles(REPO / "notebooks" / "profiles.yaml")
    assert {"cpu", "gpu", "quick"} <= set(profiles)
    assert regenerate.parameters_for(profiles, "gpu", "01_single_device_baseline.ipynb")["device"] == "cuda"


def test_discover_orders_numerically_and_selects(tmp_path):
    for name in ("10_ten.ipynb", "02_two.ipynb", "01_one.ipynb", "notes.ipynb"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in regenerate.discover(tmp_path)] == ["01_one.ipynb", "02_two.ipynb", "10_ten.ipynb"]
    assert [p.name for p in regenerate.discover(tmp_path, ["10", "01_one"])] == ["01_one.ipynb", "10_ten.ipynb"]
    with pytest.raises(ValueError, match="no such notebook"):
        regenerate.discover(tmp_path, ["07"])
