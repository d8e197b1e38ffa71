"""The `auto` parameters a chapter gets on each machine a workshop brings, from a machine description (the
machines are built here: a macOS laptop or a GPU node cannot be borrowed by a test)."""

from __future__ import annotations

import pytest

from distlab import machine
from distlab.machine import Gpu, Machine, Sections, auto_parameters, example_machines

EXAMPLES = example_machines()

# machine -> (device, dtype, rank_device, nproc, world_sizes, oversubscribe, loss_rtol, loss_atol, check_rtol)
EXPECTED = {
    "Linux laptop, 4 cores, normal user": ("cpu", "fp32", "cpu", 2, [1, 2, 4], 8, 1e-4, 1e-5, 1e-6),
    "Linux laptop, 8 cores, normal user": ("cpu", "fp32", "cpu", 2, [1, 2, 4], 0, 1e-4, 1e-5, 1e-6),
    "macOS laptop, 10 cores": ("cpu", "fp32", "cpu", 2, [1, 2, 4], 0, 1e-4, 1e-5, 1e-6),
    "cloud VM, 1 core": ("cpu", "fp32", "cpu", 2, [1, 2], 0, 1e-4, 1e-5, 1e-6),
    "one GPU (24 GiB), 16 cores": ("cuda", "bf16-autocast", "cpu", 2, [1, 2, 4], 0, 1e-4, 1e-5, 1e-3),
    "GPU node, 8 x 80 GiB, 64 cores": ("cuda", "bf16-autocast", "cuda", 8, [1, 2, 4, 8], 0, 0.05, 0.05, 1e-3),
    "the book's build VM, 2 cores, root": ("cpu", "fp32", "cpu", 2, [1, 2], 4, 1e-4, 1e-5, 1e-6),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_machine_gets_the_world_sizes_devices_dtypes_and_tolerances_it_can_run(name):
    auto = auto_parameters(EXAMPLES[name])
    got = (auto.device, auto.dtype, auto.rank_device, auto.nproc, auto.world_sizes, auto.oversubscribe,
           auto.loss_rtol, auto.loss_atol, auto.check_rtol)
    assert got == EXPECTED[name]


def test_no_world_size_asks_for_more_gpus_than_the_machine_has():
    for name, m in EXAMPLES.items():
        auto = auto_parameters(m)
        if auto.rank_device == "cuda":
            assert max(auto.world_sizes) <= len(m.gpus) and auto.nproc <= len(m.gpus), name
        # two ranks on one GPU would both call set_device(0) under NCCL: one GPU means CPU ranks
        if len(m.gpus) == 1:
            assert auto.rank_device == "cpu" and any("gloo" in n for n in auto.notes)


def test_the_one_core_vm_says_why_its_timing_claims_are_skipped():
    one = EXAMPLES["cloud VM, 1 core"]
    assert one.timing_skip(2) == "needs 2 cores (this machine gives 1): ranks would share"
    assert EXAMPLES["the book's build VM, 2 cores, root"].timing_skip(2) is None
    assert EXAMPLES["the book's build VM, 2 cores, root"].timing_skip(3) is not None
    node = EXAMPLES["GPU node, 8 x 80 GiB, 64 cores"]
    assert node.timing_skip(8, "cuda") is None and node.timing_skip(16, "cuda") is not None


def test_sections_that_need_root_slurm_or_namespaces_skip_with_one_line_naming_what_is_missing(capsys):
    laptop = Sections(EXAMPLES["Linux laptop, 8 cores, normal user"])
    assert laptop.run("1. By hand", "cores:1")
    assert not laptop.run("5. The emulated LAN", "netns")
    mac = Sections(EXAMPLES["macOS laptop, 10 cores"])
    assert not mac.run("6. The Slurm cluster", "slurm")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "skipped: 5. The emulated LAN: needs network namespaces: Linux, root and iproute2 "
        "(`sudo apt install iproute2`)",
        "skipped: 6. The Slurm cluster: needs a local Slurm cluster: Linux, root and "
        "`sudo apt install slurm-wlm munge`"]
    assert laptop.table() == [("1. By hand", "ran"),
                              ("5. The emulated LAN", "skipped: " + lines[0].split(": ", 2)[2])]
    build_vm = Sections(EXAMPLES["the book's build VM, 2 cores, root"])
    assert build_vm.run("5", "netns") and build_vm.run("6", "slurm") and build_vm.run("3", "compiler")


def test_a_claim_this_machine_cannot_check_prints_one_line_and_is_listed(capsys):
    one = Sections(EXAMPLES["cloud VM, 1 core"])
    assert one.claim("balanced faster than naive", None, None)  # nothing stops it: checked, no line, no row
    assert not one.claim("balanced faster than naive", None, one.machine.timing_skip(2), "a later reason")
    assert capsys.readouterr().out.splitlines() == [
        "not checked: balanced faster than naive: needs 2 cores (this machine gives 1): ranks would share"]
    assert one.table() == [("balanced faster than naive", "not checked: needs 2 cores (this machine gives 1): "
                                                          "ranks would share")]


def test_an_unknown_need_is_refused_with_the_needs_there_are():
    with pytest.raises(ValueError, match="need 'gpus2'.*netns"):
        EXAMPLES["cloud VM, 1 core"].missing("gpus2")


def test_an_explicit_value_always_wins_over_auto():
    assert machine.pick("auto", 4) == 4
    assert machine.pick(2, 4) == 2 and machine.pick([1, 2], [1, 2, 4]) == [1, 2]


def test_this_machine_is_described_and_its_command_prints_every_example(capsys):
    here = machine.describe()
    assert here.cores >= 1 and here.system
    assert machine.main(["--examples"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXAMPLES)
    assert "world_sizes=[1, 2, 4, 8]" in out


def test_a_gpu_with_no_name_still_counts():
    m = Machine("Linux", 4, (Gpu("", 8 * 2**30), Gpu("", 8 * 2**30)))
    assert auto_parameters(m).rank_device == "cuda" and auto_parameters(m).world_sizes == [1, 2]


def test_a_tolerance_follows_the_dtype_a_run_computes_in():
    from distlab.device import choose_device

    assert machine.tolerance("check_rtol", choose_device("cpu", "fp32")) == 1e-6
    assert machine.tolerance("check_rtol", choose_device("cpu", "bf16-autocast")) == 1e-6  # a CPU rounds alike
    assert machine.tolerance("loss_rtol", choose_device("cpu", "bf16-autocast")) == 0.05
    assert machine.tolerance("loss_rtol", choose_device("cpu", "bf16")) == 0.05


def test_the_global_batch_splits_over_every_world_size_a_machine_runs():
    assert machine.fitting_global_batch(2, [1, 2]) == 8  # the book's machine: the chapters' 8 rows
    assert machine.fitting_global_batch(2, [1, 2, 4]) == 8
    assert machine.fitting_global_batch(2, [1, 2, 4, 8]) == 16  # a GPU node's 8 ranks of 2 rows
    assert machine.fitting_global_batch(3, [1, 2]) == 24
    assert machine.fitting_global_batch(2, [1, 2, 4, 8]) == 16 and machine.fitting_global_batch(1, [3, 4]) == 24
    assert machine.fitting_global_batch(2, [1, 2, 4, 0]) == 8  # 0: no oversubscribed run
    for micro, ranks in ((2, [8]), (3, [1, 2, 4]), (4, [1, 2, 4, 8]), (2, [1, 2, 4, 8, 6])):
        rows = machine.fitting_global_batch(micro, ranks)
        assert all(rows % (micro * k) == 0 for k in ranks)
