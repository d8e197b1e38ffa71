"""A scheduler's notice in one process: the grace a measured stop needs (and a Kubernetes job's, which outlasts
it), and the stop request restoring the signal handlers it replaced. Real signals to real processes (a rank, torchrun,
Slurm's SIGUSR1): tests/launches/test_preemption_runs.py."""

from __future__ import annotations

import os
import signal

from distlab import preemption


def test_grace_fits_the_measured_stop():
    assert preemption.grace_seconds(1.0) == 30  # never below Kubernetes' default
    assert preemption.grace_seconds(40.0) == 2 * 40 + preemption.EXIT_S
    assert preemption.grace_seconds(None) == preemption.grace_seconds(preemption.UNMEASURED_STOP_S)


def test_a_kubernetes_job_outlasts_its_measured_stop():
    """torchrun waits the grace for the ranks after an eviction's SIGTERM; the pod's grace outlasts that wait."""
    from distlab.launch.catalog import KubeRun, kube_job
    from distlab.launch.kubernetes.manifests import job_manifest

    job = kube_job(KubeRun("ddp-2gpu", "ddp", 2, 50, 64, "a measured stop", 3600, stop_s=42.0))
    grace = preemption.grace_seconds(42.0)
    assert job.spec.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(grace) and grace >= 2 * 42.0
    pod = job_manifest(job)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace + preemption.EXIT_S


def test_stop_request_restores_the_handlers_it_replaced():
    before = signal.getsignal(signal.SIGTERM)
    with preemption.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signum == signal.SIGUSR1
    assert signal.getsignal(signal.SIGTERM) is before
