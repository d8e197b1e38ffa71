"""The pod's side of a KubeJob (distlab.launch.kubernetes.manifests): the entrypoint script every pod runs, and the
Dockerfile of the image it runs in.

The entrypoint (bash, the container's command): the node rank from JOB_COMPLETION_INDEX (a clear error
when it is missing, not a number or out of range), the master from MASTER_ADDR/MASTER_PORT (set by the
Job; the spec's values as defaults), a bounded wait until the master's DNS name resolves (skipped for an
IP address), then the same torchrun invocation as distlab.launch.torchrun's scripts: torchrun_flags, the
spec's environment with its network preset, `exec timeout --kill-after` around it. Every value is checked and quoted by
distlab.launch.shell, as in every other writer.

The image: torch 2.13.0 first, then distlab under requirements.lock as constraints (as `make env` does),
the default model built in and HF_HUB_OFFLINE=1; its default command is the smoke job's entrypoint.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from distlab.launch.generated import GENERATED_MARK
from distlab.launch.shell import literal_note, quote
from distlab.launch.torchrun import command_text, env_lines, plural, python_lines, torchrun_flags

if TYPE_CHECKING:
    from distlab.launch.kubernetes.manifests import KubeJob

APP_DIR = "/app"  # the repository root inside the image
K8S_DIR = "launch/k8s"  # where manifests.render_files' output lives in the repository (and the image)
# Placeholders torchrun_flags fills in; the entrypoint turns them into the shell variables it computed.
_SHELL_VALUES = {"@NODE_RANK@": '"$node_rank"', "@MASTER_ADDR@": '"$MASTER_ADDR"', "@MASTER_PORT@": '"$MASTER_PORT"'}


# ---------------------------------------------------------------------- the entrypoint

def render_entrypoint(job: KubeJob) -> str:
    """The container's command for every pod of `job` (pod i runs node rank i)."""
    job.validate()
    spec, n = job.spec, job.nnodes
    shape = f"{plural(n, 'pod')} x {plural(spec.nproc_per_node, 'process')}, world size {spec.world_size}"
    out = [
        "#!/usr/bin/env bash",
        f"# {spec.description or spec.module + ' under torchrun'}",
        "#",
        f"# The container command of the Kubernetes Indexed Job `{job.name}` ({shape}). Runs",
        f"# `{command_text(spec)}`",
        "# under torchrun. Pod i is node i: its node rank is JOB_COMPLETION_INDEX, which Kubernetes sets in",
        f"# every pod of an Indexed Job. Node 0 is the master, {job.master_host} (headless Service {job.service}).",
        f"# Waits at most {job.dns_wait_s} s for that name, then: hard limit {spec.timeout_s} s, then SIGTERM; SIGKILL "
        f"{spec.kill_after_s} s later.",
        "# Exit status 124: limit hit. Each rank prints its result between DISTLAB_RESULT markers into the pod's log.",
    ]
    if spec.network:
        out.append(f"# Network preset: {spec.network} (lib/distlab/launch/network_presets.yaml).")
    out += ["#", f"# {GENERATED_MARK} from a LaunchSpec: change the spec and regenerate, not this file."]
    out += literal_note([*spec.args, *spec.effective_env.values(), spec.log_dir, spec.python, spec.repo_root or ""])
    out += ["set -euo pipefail", ""]
    if spec.repo_root is not None:
        out += ["# Paths below are relative to the repository root (the image's working directory).",
                f'cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")"/{quote(posixpath.normpath(spec.repo_root))}', ""]
    else:
        out += ["# Paths below are relative to the directory this script is started from.", ""]
    out += python_lines(spec)
    out += [
        "say() { printf 'entrypoint: %s\\n' \"$*\"; }",
        "fail() { local status=$1; shift; printf 'entrypoint: %s\\n' \"$*\" >&2; exit \"$status\"; }",
        "",
        "# This pod's node rank: Kubernetes sets JOB_COMPLETION_INDEX (0, 1, ...) in every pod of an Indexed Job.",
        f"nnodes={n}",
        'index="${JOB_COMPLETION_INDEX:-}"',
        '[[ -n "$index" ]] || fail 2 "JOB_COMPLETION_INDEX is not set: run this as a pod of an Indexed Job' +
        ' (completionMode: Indexed), or set it to the node rank, 0..$((nnodes - 1))"',
        'if [[ ! "$index" =~ ^[0-9]{1,6}$ ]] || (( 10#$index >= nnodes )); then',
        '  fail 2 "JOB_COMPLETION_INDEX=$index is not a node rank of this job (0..$((nnodes - 1)))"',
        "fi",
        "node_rank=$((10#$index))",
        "",
        f"# The master: pod 0 of this Job, {job.master_host}. The Job sets both; the defaults are the same values.",
        f'MASTER_ADDR="${{MASTER_ADDR:-{job.master_host}}}"',
        f'MASTER_PORT="${{MASTER_PORT:-{spec.master_port}}}"',
        '[[ "$MASTER_PORT" =~ ^[0-9]{1,5}$ ]] || fail 2 "MASTER_PORT=$MASTER_PORT is not a port number"',
        "",
        "# Pods start in any order, and the master's DNS record exists only once pod 0 has an address. Wait for it,",
        "# but not forever: a missing Service must fail the pod, not hang it. An IP address needs no lookup.",
        f'dns_wait_s="${{DISTLAB_DNS_WAIT_S:-{job.dns_wait_s}}}"',
        '[[ "$dns_wait_s" =~ ^[0-9]{1,6}$ ]] || fail 2 "DISTLAB_DNS_WAIT_S=$dns_wait_s is not a number of seconds"',
        'if [[ "$MASTER_ADDR" =~ ^[0-9.]+$ || "$MASTER_ADDR" == *:* ]]; then',
        '  say "master $MASTER_ADDR is an IP address: no DNS lookup"',
        "else",
        "  deadline=$((SECONDS + dns_wait_s))",
        '  until getent hosts "$MASTER_ADDR" > /dev/null; do',
        "    if (( SECONDS >= deadline )); then",
        f'      fail 3 "$MASTER_ADDR did not resolve within $dns_wait_s s: check the headless Service '
        f'{job.service} (its selector must match this pod) and the pod\'s subdomain"',
        "    fi",
        "    sleep 2",
        "  done",
        '  say "master $MASTER_ADDR resolves"',
        "fi",
        "",
    ]
    out += env_lines(spec)
    out += [f"mkdir -p -- {quote(spec.log_dir)}",
            f'say "node $node_rank of $nnodes, master $MASTER_ADDR:$MASTER_PORT, '
            f'{plural(spec.nproc_per_node, "process")} here"',
            "",
            f"# timeout: SIGTERM after {spec.timeout_s} s, which torchrun forwards to its ranks; SIGKILL "
            f"{spec.kill_after_s} s later (the",
            "# pod's terminationGracePeriodSeconds is as long). exec: torchrun's exit status is the pod's.",
            f"exec timeout --foreground --kill-after={spec.kill_after_s}s {spec.timeout_s}s \\",
            '  "$PYTHON" -m torch.distributed.run \\']
    flags = torchrun_flags(spec.nproc_per_node, spec.nnodes, rendezvous="static", node_rank="@NODE_RANK@",
                           master_addr="@MASTER_ADDR@", master_port="@MASTER_PORT@", max_restarts=spec.max_restarts,
                           log_dir=spec.log_dir)
    for group in flags:
        out.append("  " + " ".join(_SHELL_VALUES.get(w, quote(w)) for w in group) + " \\")
    out.append("  " + " ".join(["-m", quote(spec.module), *map(quote, spec.args)]))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- the image

BASE_IMAGE = "python:3.11-slim-bookworm"


def render_dockerfile(default_job: KubeJob) -> str:
    """The benchmark's offline image, built from the repository root; its default command runs
    `default_job`'s entrypoint (each Job names its own)."""
    rel = default_job.entrypoint
    return "\n".join([
        "# syntax=docker/dockerfile:1",
        "# The strategy benchmark's offline image: the locked environment, distlab, the default model built in.",
        f"# {GENERATED_MARK}: change lib/distlab/launch/kubernetes/pod.py and regenerate, not this file.",
        "#",
        f"#   docker build -f {K8S_DIR}/Dockerfile -t IMAGE .      # from the repository root",
        "#",
        "# torch==2.13.0 from PyPI is its CUDA build on Linux x86_64 (the CUDA libraries come as pip packages; the",
        "# driver comes from the node through the NVIDIA container toolkit). Not built where it was generated: no",
        "# base image could be pulled there. Dockerfile.dockerignore keeps .venv/, build/ and .git/ out of the",
        "# build context.",
        f"ARG BASE_IMAGE={BASE_IMAGE}",
        "FROM ${BASE_IMAGE}",
        "",
        "# A C/C++ compiler: DeepSpeed and Triton compile small helpers on first use. getent (libc-bin) for the",
        "# entrypoint's DNS wait, coreutils for its timeout, both in the base image.",
        "# hadolint ignore=DL3008",
        "RUN apt-get update \\",
        "    && apt-get install -y --no-install-recommends build-essential \\",
        "    && rm -rf /var/lib/apt/lists/*",
        "",
        "ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1",
        f"WORKDIR {APP_DIR}",
        "",
        "# torch first and alone (as `make env` does), then distlab with requirements.lock as constraints, so that",
        "# every other package is the locked version and nothing replaces torch.",
        'RUN python -m pip install "torch==2.13.0"',
        "COPY . .",
        'RUN python -m pip install -c requirements.lock -e ".[deepspeed]"',
        "",
        "# The default model (a tiny Qwen2 built from the repository's data) is built now, into build/models/;",
        "# the qwen2.5-0.5b-random preset needs only its tokenizer. Then the Hub is off for good.",
        "RUN useradd --create-home --uid 1000 distlab \\",
        "    && python -c 'from distlab.tiny_base import build_default_model; print(build_default_model())' \\",
        f"    && chown -R distlab {APP_DIR}",
        "ENV HF_HUB_OFFLINE=1",
        "# the distlab user created above, by its uid (a name may not resolve on the node)",
        "USER 1000",
        "",
        f'ENTRYPOINT ["bash", "{rel}"]',
        "",
    ])


DOCKERIGNORE = "\n".join([
    f"# {GENERATED_MARK}. The build context is the repository: leave out what is big or machine-specific.",
    ".git", ".venv", "build", "book/_build", "book/notebooks", "logs", "**/__pycache__", "**/*.egg-info", ""])
