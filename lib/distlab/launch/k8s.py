"""`python -m distlab.launch.k8s`: the name earlier READMEs gave the Kubernetes command; it runs
distlab.launch.kubernetes.command (validate manifests offline, or collect a run's results)."""

from distlab.cli import run_main
from distlab.launch.kubernetes.command import main

if __name__ == "__main__":
    run_main(main)
