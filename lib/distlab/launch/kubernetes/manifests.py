"""Kubernetes: a LaunchSpec written out as plain Kubernetes resources, an entrypoint and an image.

    spec = kube_spec("ddp-2gpu", nnodes=2, nproc_per_node=1, args=[...], network="cloud-no-rdma")
    job = KubeJob("ddp-2gpu", spec, image="registry.example.com/distlab/bench:0.1.0", gpus_per_pod=1)
    files = render_files([job])   # namespace.yaml, service.yaml, jobs/, entrypoints/, Dockerfile

The shape, built-in resources only (no operator or CRD to install first):

- a Namespace and one headless Service (clusterIP: None, publishNotReadyAddresses: true) whose selector
  matches every pod of the benchmark. An Indexed Job's pod i is called `<job>-<i>`; with the pod's
  `subdomain` set to the Service, it resolves as `<job>-<i>.<service>`, before it is ready (the
  rendezvous happens before anything could be ready);
- one Indexed Job per run: completions = parallelism = nodes (a pod per node, scheduled together),
  pod i's JOB_COMPLETION_INDEX is its node rank; restartPolicy Never and, by default, backoffLimit 0:
  a static rendezvous cannot take a replacement pod back into a running group, so a lost pod fails the
  run and the run is started again; GPUs as `nvidia.com/gpu` limits; /dev/shm as a memory-backed
  emptyDir (container runtimes default to 64 MiB, too little for NCCL's shared-memory buffers and
  DataLoader workers); MASTER_ADDR = `<job>-0.<service>`; activeDeadlineSeconds as the cluster's
  backstop behind the entrypoint's own timeout. Labels `distlab.io/run=<job>` select a run's pods for
  the collector (distlab.launch.kubernetes.collect);
- the entrypoint, the container's command (bash): node rank from JOB_COMPLETION_INDEX, a bounded wait for
  the master's DNS name, then the same torchrun invocation as distlab.launch.torchrun writes
  (torchrun_flags, the spec's environment and network preset), under the same hard timeout;
- a Dockerfile: torch 2.13.0 first, then the package with requirements.lock as constraints, the
  default model pre-staged and HF_HUB_OFFLINE=1, so that the pods never reach the Hub.

The entrypoint and the Dockerfile are written by distlab.launch.kubernetes.pod, validation (offline) is in
distlab.launch.kubernetes.checks, collecting results in distlab.launch.kubernetes.collect; the command line for both is
distlab.launch.kubernetes.command:

    python -m distlab.launch.kubernetes validate FILES...
    python -m distlab.launch.kubernetes collect --namespace NS --run NAME [--out DIR]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import yaml

from distlab.launch.generated import GENERATED_MARK
from distlab.launch.kubernetes.pod import APP_DIR, DOCKERIGNORE, K8S_DIR, render_dockerfile, render_entrypoint
from distlab.launch.shell import SpecError, check_fields, show
from distlab.launch.spec import LaunchSpec

NAMESPACE = "distlab-bench"
SERVICE = "bench"
LABEL_NAME, LABEL_PART_OF = "app.kubernetes.io/name", "app.kubernetes.io/part-of"
LABEL_RUN, LABEL_STRATEGY = "distlab.io/run", "distlab.io/strategy"
GPU_RESOURCE = "nvidia.com/gpu"
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label (at most 63 characters)
DNS_1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names start with a letter
QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
# An image reference's characters ([registry[:port]/]path[:tag][@digest]): nothing a shell or YAML would read.
IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


class KubeJobError(SpecError):
    """An invalid KubeJob; `.field` names the offending field."""

    spec = "KubeJob"


def master_host(job_name: str, service: str = SERVICE) -> str:
    """Pod 0 of an Indexed Job under a headless Service: `<job>-0.<service>` (same namespace)."""
    return f"{job_name}-0.{service}"


def kube_spec(job_name: str, *, service: str = SERVICE, **fields) -> LaunchSpec:
    """A LaunchSpec for a KubeJob: static rendezvous at the job's pod 0, by its DNS name."""
    return LaunchSpec(rendezvous="static", master_addr=master_host(job_name, service), **fields)


@dataclass
class KubeJob:
    """One run on Kubernetes: the LaunchSpec (nnodes pods x nproc_per_node processes) and where it runs.

    `spec.repo_root`, when set, is relative to the entrypoints' folder (`launch/k8s/entrypoints/` in the
    repository, and in the image under APP_DIR)."""

    name: str  # the Job's name: pods are <name>-0 .. <name>-<nnodes-1>
    spec: LaunchSpec  # rendezvous "static" at master_host(name, service): see kube_spec
    image: str
    namespace: str = NAMESPACE
    service: str = SERVICE
    gpus_per_pod: int = 0  # nvidia.com/gpu per pod; 0: CPU pods
    backoff_limit: int = 0  # pods Kubernetes may replace before the Job fails
    cpu: str | None = None  # resources.requests.cpu, e.g. "8"
    memory: str | None = None  # resources.requests.memory, e.g. "64Gi"
    shm_size: str = "16Gi"  # sizeLimit of the memory-backed /dev/shm
    dns_wait_s: int = 300  # how long a pod waits for the master's DNS name

    def __post_init__(self) -> None:
        self.validate()

    @property
    def nnodes(self) -> int:
        return self.spec.nnodes

    @property
    def master_host(self) -> str:
        return master_host(self.name, self.service)

    @property
    def entrypoint(self) -> str:
        """The entrypoint's path inside the image."""
        return f"{APP_DIR}/{K8S_DIR}/entrypoints/{self.name}.sh"

    @property
    def pod_labels(self) -> dict[str, str]:
        labels = {LABEL_NAME: "distlab", LABEL_PART_OF: self.service, LABEL_RUN: self.name}
        if self.spec.effective_strategy:
            labels[LABEL_STRATEGY] = self.spec.effective_strategy
        return labels

    @property
    def deadline_s(self) -> int:
        """activeDeadlineSeconds: DNS wait, the entrypoint's limit and its kill grace, plus a minute."""
        return self.dns_wait_s + self.spec.timeout_s + self.spec.kill_after_s + 60

    def validate(self) -> None:
        self.spec.validate()
        check_fields(KubeJobError, self)  # control characters, length, secrets: before any value is quoted
        last_host = f"{self.name}-{self.nnodes - 1}"
        if not isinstance(self.name, str) or not DNS_LABEL_RE.match(self.name) or len(last_host) > 63:
            raise KubeJobError("name", f"{show(self.name)}: lower-case letters, digits and '-', short enough that the "
                                       f"last pod's host name {show(last_host)} fits 63 characters")
        if not isinstance(self.namespace, str) or not DNS_LABEL_RE.match(self.namespace) or len(self.namespace) > 63:
            raise KubeJobError("namespace", f"{show(self.namespace)} is not a DNS-1123 label")
        if not isinstance(self.service, str) or not DNS_1035_RE.match(self.service) or len(self.service) > 63:
            raise KubeJobError("service", f"{show(self.service)}: a Service name starts with a letter (DNS-1035 label)")
        if self.spec.rendezvous != "static" or self.spec.master_addr != self.master_host:
            raise KubeJobError("spec", f"needs rendezvous='static' and master_addr={show(self.master_host)} (pod 0 of "
                                       "the Job through the headless Service): build it with kube_spec()")
        if not isinstance(self.image, str) or not IMAGE_RE.match(self.image):
            raise KubeJobError("image", f"{show(self.image)} is not an image reference "
                                        "([registry/]path[:tag][@digest])")
        for name in ("gpus_per_pod", "backoff_limit", "dns_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "dns_wait_s" else 0):
                raise KubeJobError(name, f"{show(value)} is not a whole number in range")
        if self.gpus_per_pod and self.gpus_per_pod != self.spec.nproc_per_node:
            raise KubeJobError("gpus_per_pod", f"{self.gpus_per_pod} GPUs for {self.spec.nproc_per_node} processes "
                                               "per pod: local rank i takes GPU i, one each")
        for name in ("cpu", "memory", "shm_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not QUANTITY_RE.match(value)):
                raise KubeJobError(name, f"{show(value)} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")


# ---------------------------------------------------------------------- manifests

def namespace_manifest(namespace: str = NAMESPACE) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {LABEL_NAME: "distlab"}}}


def service_manifest(namespace: str = NAMESPACE, service: str = SERVICE) -> dict:
    """The headless Service that gives every benchmark pod its DNS name (selector: the part-of label)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service, "namespace": namespace, "labels": {LABEL_NAME: "distlab"}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_NAME: "distlab", LABEL_PART_OF: service}}}


def job_manifest(job: KubeJob) -> dict:
    """The Indexed Job of one run (see the module docstring for each choice)."""
    job.validate()
    spec, labels = job.spec, job.pod_labels
    resources: dict = {}
    if job.gpus_per_pod:
        resources["limits"] = {GPU_RESOURCE: job.gpus_per_pod}
    requests = {k: v for k, v in (("cpu", job.cpu), ("memory", job.memory)) if v}
    if requests:
        resources["requests"] = requests
    container = {
        "name": "train", "image": job.image, "imagePullPolicy": "IfNotPresent",
        "command": ["bash", job.entrypoint], "workingDir": APP_DIR,
        "env": [{"name": "MASTER_ADDR", "value": job.master_host},
                {"name": "MASTER_PORT", "value": str(spec.master_port)}],
        "ports": [{"name": "rendezvous", "containerPort": spec.master_port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod: dict = {"subdomain": job.service, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": spec.kill_after_s, "containers": [container],
                 "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}]}
    if job.gpus_per_pod:  # GPU nodes are often tainted so that only GPU work lands there
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    annotations = {"distlab.io/description": spec.description or f"{spec.module} under torchrun"}
    if spec.network:
        annotations["distlab.io/network"] = spec.network
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job.name, "namespace": job.namespace, "labels": dict(labels),
                         "annotations": annotations},
            "spec": {"completionMode": "Indexed", "completions": job.nnodes, "parallelism": job.nnodes,
                     "backoffLimit": job.backoff_limit, "activeDeadlineSeconds": job.deadline_s,
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def dump_yaml(docs: Sequence[dict], title: str) -> str:
    """Documents as one YAML file (`---` between them) under a commented header."""
    head = f"# {title}\n# {GENERATED_MARK} from a LaunchSpec: change the spec and regenerate, not this file.\n"
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=1000) for d in docs)
    return head + body


# ---------------------------------------------------------------------- files

def render_files(jobs: Sequence[KubeJob], default_job: str | None = None) -> dict[str, str]:
    """Relative path (under launch/k8s/) -> content: namespace.yaml, service.yaml, jobs/<name>.yaml,
    entrypoints/<name>.sh, Dockerfile (+ its .dockerignore). All jobs share namespace, Service and image."""
    if not jobs:
        raise ValueError("no jobs to write")
    first = jobs[0]
    for job in jobs:
        job.validate()
        for name in ("namespace", "service", "image"):
            if getattr(job, name) != getattr(first, name):
                raise KubeJobError(name, f"{job.name} and {first.name} differ; one benchmark shares one {name}")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise KubeJobError("name", f"job names repeat: {names}")
    default = next((j for j in jobs if j.name == (default_job or first.name)), None)
    if default is None:
        raise KubeJobError("name", f"default job {default_job!r} is none of {names}")
    files = {"namespace.yaml": dump_yaml([namespace_manifest(first.namespace)], f"Namespace {first.namespace}"),
             "service.yaml": dump_yaml([service_manifest(first.namespace, first.service)],
                                       f"Headless Service {first.service}: DNS names <job>-<index>.{first.service} "
                                       "for the benchmark's pods")}
    for job in jobs:
        title = f"Indexed Job {job.name}: {job.spec.description or job.spec.module}"
        files[f"jobs/{job.name}.yaml"] = dump_yaml([job_manifest(job)], title)
        files[f"entrypoints/{job.name}.sh"] = render_entrypoint(job)
    files["Dockerfile"] = render_dockerfile(default)
    files["Dockerfile.dockerignore"] = DOCKERIGNORE
    return files


# ---------------------------------------------------------------------- command line
