"""Shared fixtures, and the tiers: each test's folder (tests/unit, launches, notebooks, clusters) is its marker, the
last three are `slow`, and an unmarked test that runs longer than UNMARKED_LIMIT_S fails (tests/tiers.py). The
default model is built once per machine (cached under build/models)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import psutil
import pytest

import tiers  # tests/tiers.py: pytest put this folder, the one of this conftest.py, on sys.path

pytest_plugins = ["pytester"]  # the `pytester` fixture: tests/unit/test_tiers.py runs planted tests with it

# One thread per process, as on the tutorial's CPU runs: tests that compare numbers across
# processes need the same reduction order, and two cores must serve pytest and its children.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The longest call an unmarked test may take, in seconds: over it, a test that passed fails, naming itself. The fast
# tier (`make test-fast`: lint and tests/unit, less what is marked slow, under 2 minutes on the 2-core CI machine)
# stays fast only if a slow test cannot slip into it unnoticed. It must not flake: only the call phase counts (the
# test itself, not the fixtures it shares with others, such as the model built once), and the tests that took over
# ~2.5 s there are marked slow, so the slowest unmarked one (2.2 s) passes even twice as slow on a busy machine
# (the same test was measured 1.5-1.7x slower under load). It holds everywhere, CI included: there is no switch to
# turn it off; mark the test slow or make it faster.
UNMARKED_LIMIT_S = 5.0


def pytest_configure(config):
    tiers.register(config)


def pytest_collection_modifyitems(config, items):
    tiers.mark(items, Path(__file__).parent)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    return tiers.hold_to_the_limit(item, report, UNMARKED_LIMIT_S)


def pytest_unconfigure(config):
    """A child process a test left running would hold the suite's exit for ever (multiprocessing's exit handler
    joins every non-daemon child): CI once ran out of time so, after a test with a hung rank had failed. Kill them."""
    for child in multiprocessing.active_children():
        print(f"[conftest] killed {child.name} (pid {child.pid}): a test left it running", file=sys.stderr)
        child.kill()
        child.join()


@pytest.fixture(scope="session")
def tokenizer():
    from distlab.models import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from distlab.models import load_model

    torch.set_num_threads(1)
    model = load_model(None)
    model.eval()
    return model


@pytest.fixture(scope="session")
def random_tiny_dir():
    """A seeded random-weight checkpoint of the tiny shape, written once ("test-tiny"): the pipeline-inference
    tests' model, in-process (tests/unit) and launched (tests/launches)."""
    from distlab.inference.stage_weights import random_checkpoint

    return random_checkpoint("test-tiny")


@pytest.fixture(scope="session")
def random_tiny_tokenizer(random_tiny_dir):
    from distlab.models import load_tokenizer

    return load_tokenizer(random_tiny_dir)


@pytest.fixture(scope="session")
def checkpointed_run(tmp_path_factory):
    """A finished 3-step run of tiny_lora.yaml, its checkpoint after step 2 (the safe-load tests of both tiers);
    tests copy it before changing it."""
    from distlab import checkpoint
    from distlab.train import main
    from helpers import checkpointed_run_argv

    out = tmp_path_factory.mktemp("safe_load") / "run"
    assert main(checkpointed_run_argv(out)) == 0
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002"]
    return out


# ---------------------------------------------------------------------- the emulated LAN (chapter 05)

@pytest.fixture
def clean():
    """No namespace or cgroup of ours before the test, and none left after it."""
    from distlab.lan import hosts

    hosts.down()
    yield
    assert not hosts.leftovers(), f"left behind: {hosts.leftovers()}"


def _processes_matching(marker: str) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                alive.append(p)
        except psutil.Error:
            pass
    return alive


@pytest.fixture
def our_processes():
    """our_processes(marker): the live processes whose command line contains `marker`."""
    return _processes_matching


# ---------------------------------------------------------------------- the one-machine Slurm cluster (chapter 06)

@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """`cluster`: a Slurm cluster for the module's tests (the controller on the module's SLURM_CTLD_PORT, the two nodes
    on the next two ports), down after them, leaving nothing running. Each module has ports of its own, so
    two modules' clusters never meet, even when two pytest sessions run at once."""
    from distlab.slurm.cluster import Cluster  # deferred: only the Slurm tests need it

    port = request.module.SLURM_CTLD_PORT
    c = Cluster(root=tmp_path_factory.mktemp("slurm"), ctld_port=port, node_ports=(port + 1, port + 2))
    c.up()
    try:
        yield c
    finally:
        c.down()
        assert c.processes() == []
