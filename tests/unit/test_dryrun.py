"""Every profile against every chapter, without running anything (python -m distlab.publish.dryrun)."""

from __future__ import annotations

import shutil

from distlab import paths
from distlab.publish import dryrun


def test_every_profile_builds_every_launch_of_every_chapter():
    problems, report = dryrun.check()
    assert not problems, "\n".join(map(str, problems))
    assert any(line.startswith("gpu") and "02_ddp_scaling" in line and "world size 1, 2, 4, 8" in line
               for line in report), report


def test_an_undeclared_parameter_and_an_indivisible_batch_are_found(tmp_path):
    for nb in ("02_ddp_scaling.ipynb", "03_fsdp_and_zero.ipynb"):
        shutil.copy(paths.NOTEBOOKS_DIR / nb, tmp_path / nb)
    (tmp_path / "profiles.yaml").write_text(
        'bad:\n  "*": {micro_batch_size: 8}\n  "02": {nproc: 8, global_batch_size: 8}\n'
        '  "03": {global_batch_size: 12}\n')
    problems, _ = dryrun.check(["bad"], tmp_path)
    text = "\n".join(map(str, problems))
    assert "02_ddp_scaling [bad]: profile parameter 'nproc' is declared by no parameters cell" in text
    assert "global_batch_size=8 is not divisible by micro_batch_size x world_size = 8 x 2" in text
    assert "global_batch_size=12 is not divisible" in text


def test_the_parameters_cell_is_read_as_the_notebook_declares_it():
    defaults = dryrun.notebook_defaults(paths.NOTEBOOKS_DIR / "02_ddp_scaling.ipynb")
    assert defaults["world_sizes"] == "auto" and "figures_dir" in defaults


def test_auto_launch_values_are_checked_on_every_machine_a_workshop_brings():
    _, report = dryrun.check(["cpu"])
    line = next(line for line in report if "02_ddp_scaling" in line)
    assert "world size 1, 2, 4, 8" in line and line.endswith(": ok")  # the GPU node's 8 ranks, its batch of 16
    params = {"world_sizes": "auto", "oversubscribe": "auto", "nproc": 2, "micro_batch_size": 2,
              "global_batch_size": "auto"}
    machines = dict(dryrun.on_machines(params, gpus_only=False))
    assert machines["GPU node, 8 x 80 GiB, 64 cores"]["global_batch_size"] == 16
    assert machines["the book's build VM, 2 cores, root"]["world_sizes"] == [1, 2]
    assert [name for name, _ in dryrun.on_machines(params, gpus_only=True)] == [
        "one GPU (24 GiB), 16 cores", "GPU node, 8 x 80 GiB, 64 cores"]
