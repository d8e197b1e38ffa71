"""The project's own contracts: pins agree, notebooks are stored clean, the README leads with the two commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_lock_and_environment_yml_carry_the_same_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_pins = {}
    for item in pip_section:
        if item.startswith("-e"):
            continue
        name, version = item.split("==")
        conda_pins[name.lower()] = version
    assert conda_pins == lock_pins()


def test_lock_pins_torch_and_the_required_packages():
    pins = lock_pins()
    assert pins["torch"] == "2.13.0"
    for name in ("transformers", "peft", "deepspeed", "accelerate", "papermill", "jupyterlab", "ipykernel",
                 "ipywidgets", "matplotlib", "pandas", "tokenizers", "safetensors", "psutil", "tqdm", "pyyaml",
                 "pytest", "jupyter-book"):
        assert name in pins, f"{name} missing from requirements.lock"
    assert pins["jupyter-book"].startswith("1."), "Jupyter Book 2 cannot build offline here"


def test_installed_versions_match_the_lock():
    from importlib import metadata

    pins = lock_pins()
    for name in ("transformers", "peft", "deepspeed", "papermill", "jupyter-book"):
        assert metadata.version(name) == pins[name]
    assert metadata.version("torch").split("+")[0] == "2.13.0"


def test_notebooks_are_stored_without_outputs():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, \
                    f"{path.name} cell {i} has outputs"


def test_every_notebook_cell_has_a_unique_id():
    """nbformat 4.5 cell ids: papermill and Jupyter Book keep them; a missing one is only a warning today."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "tests" / "fixtures").rglob("*.ipynb")):
        nb = json.loads(path.read_text())
        ids = [cell.get("id") for cell in nb["cells"]]
        assert all(ids) and len(set(ids)) == len(ids), f"{path.name}: cells without an id, or repeated ids"


def test_notebooks_have_a_parameters_cell():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: expected exactly one cell tagged 'parameters'"


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    head = text[:2500]
    commands = re.findall(r"^\s*(make \w+)\s*$", head, flags=re.M)
    assert commands[:2] == ["make book", "make test"]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
