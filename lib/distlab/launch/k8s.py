"""The Kubernetes command line: validate manifests offline, or collect a run's results from its pods.

    python -m distlab.launch.k8s validate launch/k8s                       # schemas 1.30 + 1.34, distlab's checks
    python -m distlab.launch.k8s collect --namespace NS --run NAME [--out DIR]

Kept apart from distlab.launch.kubernetes (the manifests), which the package imports: a module that the
package has already imported cannot also run as `python -m`.
"""

from __future__ import annotations

import argparse

from distlab.cli import run_main
from distlab.launch import kubecheck, kubecollect
from distlab.launch.kubernetes import NAMESPACE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.launch.k8s",
                                 description="Validate the benchmark's Kubernetes manifests offline, or collect a "
                                             "run's results from its pods' logs.")
    sub = ap.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help="strict schema validation (two Kubernetes versions) and distlab's checks")
    val.add_argument("files", nargs="+", help="YAML files or folders (folders: every *.yaml under them)")
    val.add_argument("--versions", default=None, help="comma-separated Kubernetes versions (default: 1.30,1.34)")
    col = sub.add_parser("collect", help="kubectl logs of every pod of a run -> the result markers, checked")
    col.add_argument("--namespace", "-n", default=NAMESPACE)
    col.add_argument("--run", required=True, help="the Job's name (pods labelled distlab.io/run=NAME)")
    col.add_argument("--out", default=None, help="folder for <run>/pods/<pod>.log and <run>/results.json")
    args = ap.parse_args(argv)
    if args.command == "validate":
        versions = tuple(v.strip() for v in args.versions.split(",")) if args.versions else kubecheck.VERSIONS
        return kubecheck.main_validate(args.files, versions)
    return kubecollect.main_collect(args.namespace, args.run, args.out)


if __name__ == "__main__":
    run_main(main)
