"""The repository's launch/ folder: the enterprise demo's launch matrix, written from `DEMO_MATRIX`, and
the strategy benchmark on Kubernetes in launch/k8s/, written from `KUBE_MATRIX`.

    python -m distlab.launch regenerate   # rewrite launch/ (and launch/k8s/) from the two matrices
    python -m distlab.launch check        # exit 1 naming every file that differs from the writer

Each DEMO_MATRIX row is one run of the enterprise assistant's LoRA fine-tuning with DDP (1 GPU, 4 GPUs,
and two LAN nodes of 4 GPUs); `demo_spec` turns a row into a LaunchSpec, torchrun.py writes it. Each
KUBE_MATRIX row is one Indexed Job of the Kubernetes case study's benchmark (a 1-GPU smoke job, then DDP, FSDP,
ZeRO-2 and ZeRO-3 on 2 and 4 pods of one GPU); `kube_job` turns a row into a KubeJob, manifests.py
writes its manifest and entrypoint, plus the shared Namespace, Service and Dockerfile.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from distlab import markdown
from distlab.config import load_config
from distlab.launch.generated import GENERATED_MARK, check_dir, extra_files, regenerate
from distlab.launch.kubernetes import manifests
from distlab.launch.kubernetes.manifests import KubeJob, kube_spec
from distlab.launch.kubernetes.manifests import render_files as render_kube
from distlab.launch.network import describe
from distlab.launch.sbatch import example_files as slurm_files
from distlab.launch.shell import quote
from distlab.launch.spec import LaunchSpec
from distlab.launch.torchrun import plural, render_files
from distlab.paths import LAUNCH_DIR, REPO_ROOT
from distlab.preemption import EXIT_S, UNMEASURED_STOP_S, grace_seconds

ENTERPRISE_CONFIG = "lib/distlab/configs/enterprise_7b_lora.yaml"
LAN_MASTER = "192.168.1.100"  # the LAN-cluster guide's master node; workers at .101, .102
LAN_WORKER = "192.168.1.101"
LAN_PORT = 29500
LAN_IFNAME = "eth0"  # placeholder: the NIC on 192.168.1.0/24, see `ip -br addr` on each node
GENERATOR_FILE = "lib/distlab/launch/catalog.py"  # named in launch/README.md


@dataclass(frozen=True)
class DemoRun:
    """One row of the enterprise demo's launch matrix."""

    name: str
    nnodes: int
    gpus_per_node: int
    max_steps: int
    purpose: str
    timeout_s: int  # several times the expected duration: a hard stop, not a schedule


DEMO_MATRIX: tuple[DemoRun, ...] = (
    DemoRun("run_1gpu", nnodes=1, gpus_per_node=1, max_steps=80, purpose="baseline throughput",
            timeout_s=2 * 3600),
    DemoRun("run_4gpu", nnodes=1, gpus_per_node=4, max_steps=150, purpose="main live demo",
            timeout_s=3600),
    DemoRun("run_2node_8gpu", nnodes=2, gpus_per_node=4, max_steps=200,
            purpose="precomputed scaling over the LAN", timeout_s=2 * 3600),
)


def demo_spec(row: DemoRun) -> LaunchSpec:
    """The LaunchSpec of one matrix row; batch sizes come from the config file itself."""
    cfg = load_config(REPO_ROOT / ENTERPRISE_CONFIG)
    env = {"OMP_NUM_THREADS": "1"}
    notes = {"OMP_NUM_THREADS": "one CPU thread per rank on every run, so the scaling runs differ only in GPUs"}
    common = dict(
        module="distlab.train",
        args=["--config", ENTERPRISE_CONFIG, "--set", "strategy=ddp", "--set", f"max_steps={row.max_steps}",
              "--set", f"output_dir=build/runs/enterprise_7b/{row.name}"],
        nproc_per_node=row.gpus_per_node, nnodes=row.nnodes, strategy="ddp",
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
        log_dir=f"logs/{row.name}", timeout_s=row.timeout_s, repo_root="..",
        description=(f"Enterprise assistant LoRA demo, {row.purpose}: {plural(row.nnodes, 'node')} x "
                     f"{plural(row.gpus_per_node, 'GPU')}, {row.max_steps} steps"),
    )
    if row.nnodes == 1:
        return LaunchSpec(**common, env={**env, "NCCL_DEBUG": "WARN"}, env_notes=notes)
    env.update({"NCCL_SOCKET_IFNAME": LAN_IFNAME, "GLOO_SOCKET_IFNAME": LAN_IFNAME,
                "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"})
    notes["NCCL_SOCKET_IFNAME"] = (f"the NIC on the 192.168.1.0/24 LAN; {LAN_IFNAME} is a placeholder, "
                                   "check `ip -br addr` on each node")
    return LaunchSpec(**common, env=env, env_notes=notes, rendezvous="static", master_addr=LAN_MASTER,
                      master_port=LAN_PORT, hosts=[LAN_MASTER, LAN_WORKER][:row.nnodes])


def render_demo_readme(matrix: Sequence[DemoRun] = DEMO_MATRIX) -> str:
    specs = [(row, demo_spec(row)) for row in matrix]
    lines = [
        "# Launch scripts",
        "",
        f"{GENERATED_MARK} (`python -m distlab.launch regenerate`, from `DEMO_MATRIX` in "
        f"`{GENERATOR_FILE}`): do not edit them by hand. `python -m distlab.launch check`, and the "
        "test suite, fail when these files differ from what the generator writes.",
        "",
        "The enterprise assistant demo's launch matrix: LoRA fine-tuning of "
        "`Qwen/Qwen2.5-7B-Instruct` with DDP, configured by "
        f"`{ENTERPRISE_CONFIG}` (global batch of 64 rows per step at every world size).",
        "",
        "| script | nodes x GPUs | world | steps | accumulation | purpose | hard limit |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, spec in specs:
        target = f"[`{row.name}.sh`]({row.name}.sh)" if row.nnodes == 1 else \
            f"[`{row.name}/`]({row.name}/README.md)"
        accum = spec.global_batch_size // (spec.micro_batch_size * spec.data_parallel_size)
        lines.append(f"| {target} | {row.nnodes} x {row.gpus_per_node} | {spec.world_size} | {row.max_steps} | "
                     f"{accum} | {markdown.cell(row.purpose)} | {row.timeout_s // 60} min |")
    lines += [
        "",
        "Each script changes to the repository root, runs "
        "`python -m distlab.train --config ... --set strategy=ddp --set max_steps=N` under torchrun "
        "and stops it at the hard limit (exit status 124). Use another interpreter with "
        "`PYTHON=/path/to/venv/bin/python launch/run_4gpu.sh`. Per-rank logs go to `logs/<script>/`, the "
        "run's metrics and adapter to `build/runs/enterprise_7b/<script>/`.",
        "",
        "The two-node run follows the LAN cluster's addresses (master `192.168.1.100`, port 29500, NCCL "
        f"over Ethernet); its README says which node runs which script and how to check the nodes first. "
        f"`{LAN_IFNAME}` is a placeholder for the LAN interface.",
        "",
        "Secrets (an HF_TOKEN for gated models) come from your environment, never from these files.",
        "",
        "[`k8s/`](k8s/README.md) holds the strategy benchmark as Kubernetes Indexed Jobs (manifests, entrypoints, "
        "Dockerfile), written from the same LaunchSpec.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the benchmark on Kubernetes

K8S_IMAGE = "registry.example.com/distlab/bench:0.1.0"  # placeholder: the registry and tag you push to
K8S_CONFIG = "lib/distlab/configs/tiny_lora.yaml"
K8S_NETWORK = "cloud-no-rdma"  # the Kubernetes benchmark's GPU VMs have no RDMA
K8S_STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")


@dataclass(frozen=True)
class KubeRun:
    """One row of the strategy benchmark on Kubernetes: an Indexed Job of `pods` pods with one GPU each."""

    name: str
    strategy: str
    pods: int
    max_steps: int
    global_batch_size: int
    purpose: str
    timeout_s: int
    stop_s: float | None = None  # a stop's measured cost (python -m distlab.preemption <run folder>); None: budget


KUBE_MATRIX: tuple[KubeRun, ...] = (
    KubeRun("smoke-1gpu", "single", 1, 10, 4, "smoke test of the image, GPU, DNS and result markers", 1200),
    *(KubeRun(f"{s}-{n}gpu", s, n, 50, 64, "strategy benchmark", 3600) for s in K8S_STRATEGIES for n in (2, 4)),
)


def kube_job(row: KubeRun):
    """The KubeJob of one row: the GPU profile of chapter 03 (the 0.5B-shaped random model, bf16 autocast)."""
    sets = {"strategy": row.strategy, "model": "qwen2.5-0.5b-random", "device": "cuda", "dtype": "bf16-autocast",
            "seq_len": 1024, "micro_batch_size": 4, "global_batch_size": row.global_batch_size, "lr": "1.0e-3",
            "max_steps": row.max_steps, "progress": "false", "output_dir": f"build/runs/k8s/{row.name}"}
    args = ["--config", K8S_CONFIG] + [w for k, v in sets.items() for w in ("--set", f"{k}={v}")]
    # An eviction's SIGTERM reaches torchrun, which forwards it and waits its shutdown timeout for the ranks to
    # finish the step and save (distlab.preemption); the pod's grace (kill_after_s) outlasts that wait.
    grace = grace_seconds(row.stop_s)
    basis = f"a stop measured at {row.stop_s:g} s" if row.stop_s is not None else (
        f"an unmeasured {UNMEASURED_STOP_S:g} s stop budget (measure one: python -m distlab.preemption <run folder>)")
    spec = kube_spec(row.name, module="distlab.train", args=args, nproc_per_node=1, nnodes=row.pods,
                     strategy=row.strategy, micro_batch_size=4, global_batch_size=row.global_batch_size,
                     env={"NCCL_DEBUG": "WARN", "TOKENIZERS_PARALLELISM": "false",
                          "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace)}, network=K8S_NETWORK,
                     log_dir=f"logs/k8s/{row.name}",
                     env_notes={"NCCL_DEBUG": "NCCL's log level: WARN puts only warnings and errors in the pod's log",
                                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": f"how long torchrun lets the ranks finish the step "
                                f"and save a checkpoint after an eviction's SIGTERM: sized for {basis}"},
                     timeout_s=row.timeout_s, repo_root="../../..", kill_after_s=grace + EXIT_S,
                     description=f"{row.strategy} on {plural(row.pods, 'pod')} x 1 GPU, {row.max_steps} steps: "
                                 f"{row.purpose} (Kubernetes)")
    return KubeJob(row.name, spec, image=K8S_IMAGE, gpus_per_pod=1, cpu="4", memory="32Gi")


def render_kube_readme(matrix: Sequence[KubeRun] = KUBE_MATRIX) -> str:
    ns, svc = manifests.NAMESPACE, manifests.SERVICE
    lines = [
        "# The strategy benchmark on Kubernetes",
        "",
        f"{GENERATED_MARK} (`python -m distlab.launch regenerate`, from `KUBE_MATRIX` in `{GENERATOR_FILE}`; "
        "the shapes in `lib/distlab/launch/kubernetes/manifests.py`): do not edit them by hand. "
        "`python -m distlab.launch check`, and the test suite, fail when these files differ from what the generator "
        "writes.",
        "",
        "**Validated offline, not run on a cluster.** Every manifest passes strict schema validation for "
        "Kubernetes 1.30 and 1.34 (`kubernetes-validate`) and distlab's own checks; the entrypoint ran for real "
        "as two local processes (a finished 2-node DDP run on CPU, `tests/clusters/test_kubernetes_runs.py`). The "
        "image was not built: no base image can be pulled on the machines that wrote these files.",
        "",
        "| job | strategy | pods x GPUs | world | steps | global batch | purpose | hard limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in matrix:
        lines.append(f"| [`{row.name}`](jobs/{row.name}.yaml) | {row.strategy} | {row.pods} x 1 | {row.pods} | "
                     f"{row.max_steps} | {row.global_batch_size} | {markdown.cell(row.purpose)} | "
                     f"{row.timeout_s // 60} min |")
    lines += [
        "",
        f"- `namespace.yaml`, `service.yaml`: the namespace `{ns}` and the headless Service `{svc}` "
        "(`clusterIP: None`, `publishNotReadyAddresses: true`): pod i of job J resolves as "
        f"`J-i.{svc}` as soon as it has an address.",
        "- `jobs/<job>.yaml`: one Indexed Job per run, a pod per node (`completions` = `parallelism` = pods, "
        f"`subdomain: {svc}`, `restartPolicy: Never`, `backoffLimit: 0`, one `nvidia.com/gpu` each, `/dev/shm` in "
        f"memory), `MASTER_ADDR=<job>-0.{svc}`; labelled `distlab.io/run=<job>`.",
        "- `entrypoints/<job>.sh`: the container's command. Node rank from `JOB_COMPLETION_INDEX`, a bounded wait "
        "for the master's DNS name, then the same torchrun command as the scripts in `launch/`, under a hard limit. "
        "Every rank prints its result between `DISTLAB_RESULT` markers into the pod's log.",
        "- `Dockerfile`: torch 2.13.0, then distlab with `requirements.lock` as constraints, the default model "
        "built in, `HF_HUB_OFFLINE=1`. The runs use the 0.5B-shaped random model (`qwen2.5-0.5b-random`), which "
        f"needs only the built-in tokenizer. `{K8S_IMAGE}` is a placeholder: set `K8S_IMAGE` and regenerate.",
        "",
        "## Run (one job at a time: each takes all its GPUs)",
        "",
        "```bash",
        f"docker build -f launch/k8s/Dockerfile -t {K8S_IMAGE} . && docker push {K8S_IMAGE}",
        "python -m distlab.launch.kubernetes validate launch/k8s          # offline: schema + distlab's checks",
        "kubectl apply -f launch/k8s/namespace.yaml -f launch/k8s/service.yaml",
        "kubectl apply -f launch/k8s/jobs/smoke-1gpu.yaml",
        f"kubectl wait --namespace {ns} --for=condition=complete job/smoke-1gpu --timeout=30m",
        f"python -m distlab.launch.kubernetes collect --namespace {ns} --run smoke-1gpu --out build/k8s",
        f"kubectl delete --namespace {ns} job/smoke-1gpu",
        "```",
        "",
        "`collect` reads each pod's whole log (`kubectl logs`, one pod at a time) and checks every rank's result; "
        "`build/k8s/<job>/` then holds the logs, `console.log` and `results.json`, and "
        "`distlab.results.extract.collect_run('build/k8s/<job>')` reads it like a local run.",
        "",
        f"## Network: `{K8S_NETWORK}`",
        "",
        "Every entrypoint exports the preset's variables (names and reasons in "
        "`lib/distlab/launch/network_presets.yaml`; any launch target takes `LaunchSpec(network=...)`):",
        "",
        describe().rstrip(),
        "",
        "On Kubernetes, `rdma-infiniband` also needs the HCAs inside the pods (an RDMA device plugin, or "
        "`hostNetwork`); the preset only sets NCCL's side.",
        "",
        "## Why plain Indexed Jobs",
        "",
        "Kubeflow's PyTorchJob (Training Operator) and TrainJob (Trainer v2), or Volcano (TorchX's Kubernetes "
        "scheduler renders a Volcano job) add gang scheduling and restarts, but need their operator and custom "
        "resources installed first, and no offline schema covers those. An Indexed Job (stable since Kubernetes "
        "1.24) with a headless Service gives each pod its node rank and a stable DNS name, which is all torchrun's "
        "static rendezvous needs, with built-in resources only. What it lacks: no gang scheduling (a job whose "
        "pods do not all fit waits with some pods holding GPUs; the DNS wait and the hard limit bound that) and no "
        "elastic restart (a lost pod fails the run). The Kubernetes case study's master job, worker job and "
        "ClusterIP Service become one Job whose pod 0 is the master.",
        "",
    ]
    return "\n".join(lines)


def kube_files(matrix: Sequence[KubeRun] = KUBE_MATRIX) -> dict[str, str]:
    """Relative path under launch/k8s/ -> content."""
    files = render_kube([kube_job(row) for row in matrix], default_job=matrix[0].name)
    files["README.md"] = render_kube_readme(matrix)
    return files


def launch_files(matrix: Sequence[DemoRun] = DEMO_MATRIX,
               kube_matrix: Sequence[KubeRun] | None = KUBE_MATRIX) -> dict[str, str]:
    """Relative path under launch/ -> content, for the whole matrix plus launch/README.md, and the
    Kubernetes benchmark under k8s/ (kube_matrix=None: without it)."""
    files: dict[str, str] = {}
    for row in matrix:
        files.update(render_files(demo_spec(row), row.name))
    files["README.md"] = render_demo_readme(matrix)
    if kube_matrix:
        files.update({f"k8s/{rel}": text for rel, text in kube_files(kube_matrix).items()})
    files.update({f"slurm/{rel}": text for rel, text in slurm_files().items()})
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["regenerate", "check"],
                    help="regenerate: rewrite the folder from DEMO_MATRIX and KUBE_MATRIX; check: exit 1 if it "
                         "differs")
    ap.add_argument("--dir", type=Path, default=LAUNCH_DIR, help="the launch folder (default: launch/)")
    args = ap.parse_args(argv)
    files = launch_files()
    shown = _shown(args.dir)
    if args.command == "regenerate":
        written = regenerate(args.dir, files)
        print(f"{shown}: wrote {len(written)} files")
        return 0
    problems = check_dir(args.dir, files)
    if problems:
        print(f"{shown}: {len(problems)} file(s) differ from what distlab.launch writes:")
        for p in problems:
            print(f"  {p}")
        extra = [rel for rel, _ in extra_files(args.dir, files)]
        if extra:
            # Exactly what to delete, in a form that can be pasted: regenerate deletes only its own
            # stale output, never a person's file or a link.
            print(f"Extra files ({len(extra)}), to delete: rm -- " + " ".join(quote(str(Path(args.dir) / rel))
                                                                       for rel in extra))
        print("Run `python -m distlab.launch regenerate` (and review the diff).")
        return 1
    print(f"{shown}: up to date ({len(files)} files)")
    return 0


def _shown(path: Path) -> str:
    """The folder as the user knows it: relative to the repository root when inside it."""
    try:
        return Path(path).resolve().relative_to(Path(REPO_ROOT).resolve()).as_posix() + "/"
    except ValueError:
        return str(path)
