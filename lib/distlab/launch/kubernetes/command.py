"""The Kubernetes command line: validate manifests offline, or collect a run's results from its pods.

    python -m distlab.launch.kubernetes validate launch/k8s        # schemas 1.30 + 1.34, distlab's checks
    python -m distlab.launch.kubernetes collect --namespace NS --run NAME [--out DIR]

(`python -m distlab.launch.k8s`, the name earlier READMEs used, runs the same.)
"""

from __future__ import annotations

import argparse

from distlab.cli import run_main
from distlab.launch.kubernetes import checks, collect
from distlab.launch.kubernetes.manifests import NAMESPACE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.launch.kubernetes",
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
        versions = tuple(v.strip() for v in args.versions.split(",")) if args.versions else checks.VERSIONS
        return checks.main_validate(args.files, versions)
    return collect.main_collect(args.namespace, args.run, args.out)


if __name__ == "__main__":
    run_main(main)
