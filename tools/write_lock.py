"""Write requirements.lock and environment.yml from a freshly installed environment (make lock)."""

import subprocess
import sys
from pathlib import Path

HEADER = ("# distlab pinned environment. Generated from a clean install on the 2-core CPU machines; "
          "'make lock' refreshes it.\n"
          "# torch is pinned to 2.13.0: on the project machines pip takes the local CPU build. "
          "GPU users: install the CUDA/ROCm torch 2.13.0 first.\n")


def main(venv: str) -> None:
    freeze = subprocess.run([f"{venv}/bin/pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    pins = sorted((line for line in freeze if "==" in line and not line.lower().startswith("torch==")), key=str.lower)
    Path("requirements.lock").write_text(HEADER + "torch==2.13.0\n" + "\n".join(pins) + "\n")
    env = ["# Conda environment for distlab, carrying exactly the pins of requirements.lock",
           "# (tests/unit/test_packaging.py checks that the two agree). GPU users: install a CUDA/ROCm",
           "# build of torch 2.13.0 first, then `pip install -r requirements.lock`.",
           "name: distlab", "channels:", "  - conda-forge", "dependencies:", "  - python=3.11", "  - pip", "  - pip:"]
    env += [f"    - {p}" for p in ["torch==2.13.0", *pins, "-e ."]]
    Path("environment.yml").write_text("\n".join(env) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
