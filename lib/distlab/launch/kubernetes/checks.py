"""Offline validation of Kubernetes manifests: the API schema, and what the schema cannot see.

    python -m distlab.launch.kubernetes validate launch/k8s       # every *.yaml under the folder
    problems = validate_files(["launch/k8s"])                     # {file: [Problem, ...]}, [] when OK

No cluster is needed, nor reachable here (`kubectl --dry-run=client` still asks a server for its API
list). Two layers:

- `schema`: strict validation with the `kubernetes-validate` package (a test/dev dependency; it ships the
  JSON schemas of Kubernetes 1.25-1.37) against each of VERSIONS: unknown fields, wrong types and missing
  required fields fail. It does not check enum values, names, restart policies or a missing image;
- distlab's own checks, each named (a broken manifest is rejected by each, see tests/unit/test_kubernetes.py):
  `names` (DNS-1123 labels, DNS-1035 for Services, label values), `pod-hostname` (`<job>-<last index>`
  still fits 63 characters), `completion-mode` (Indexed), `parallelism` (= completions), `restart-policy`
  (Never or OnFailure, which a Job allows; Never when pods rendezvous), `headless-service` (clusterIP None,
  publishNotReadyAddresses, a selector matching the Job's pod labels), `subdomain` (= a headless Service
  in the same namespace), `master-addr` (`<job>-0.<service>`, and a port), `image`, `shm` (/dev/shm
  memory-backed), `run-label` (what the collector selects pods by), and the generator's own rules
  (distlab.launch.kubernetes.manifests, distlab.launch.shell), so that a hand-edited manifest is held to
  what a generated one could be: `resources` (GPUs a whole number, other quantities as KubeJob accepts
  them), `secrets` (no literal value for a secret-looking variable, no credential-looking value in a
  container's env, command or args: the secret rule of every script writer) and `duplicates` (one
  object per kind, namespace and name across all files given; kubectl would apply the last one).

An empty file, one with only comments, a file that is not UTF-8 and a folder without YAML files are
errors too: a path that names nothing to check must not pass.

Checks that relate documents (a Job and its Service) look at all files given together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from distlab import yaml_input
from distlab.launch.kubernetes.manifests import DNS_1035_RE, DNS_LABEL_RE, GPU_RESOURCE, LABEL_RUN, QUANTITY_RE
from distlab.launch.shell import looks_like_secret_name, looks_like_secret_value, show

VERSIONS = ("1.30", "1.34")
CHECKS = ("schema", "names", "pod-hostname", "completion-mode", "parallelism", "restart-policy", "headless-service",
          "subdomain", "master-addr", "image", "shm", "run-label", "resources", "secrets", "duplicates")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Problem:
    check: str  # one of CHECKS
    where: str  # "Job ddp-2gpu"
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.where}: {self.message}"


@dataclass
class Doc:
    file: str
    index: int  # position in its file
    body: dict

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", "?"))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", "?"))

    @property
    def namespace(self) -> str | None:
        return (self.body.get("metadata") or {}).get("namespace")

    @property
    def where(self) -> str:
        return f"{self.kind} {self.name}"


# ---------------------------------------------------------------------- reading

def yaml_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, and every *.yaml / *.yml under the folders named, in a stable order."""
    out: dict[Path, Path] = {}  # resolved -> as given: a file named twice (or through a folder) is read once
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix in (".yaml", ".yml") and q.is_file())
            if not found:
                raise FileNotFoundError(f"{p}: no *.yaml or *.yml file under this folder")
        elif p.is_file():
            found = [p]
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
        for q in found:
            out.setdefault(q.resolve(), q)
    return list(out.values())


def load_docs(path: Path) -> tuple[list[Doc], list[Problem]]:
    try:
        bodies = yaml_input.load_file(path, all_documents=True)
    except yaml_input.YamlInputError as e:
        return [], [Problem("schema", str(path), f"not valid YAML: {e}")]
    docs, problems = [], []
    for i, body in enumerate(b for b in bodies if b is not None):
        if not isinstance(body, dict) or "kind" not in body or "apiVersion" not in body:
            problems.append(Problem("schema", f"document {i + 1}", "not a Kubernetes object (kind, apiVersion)"))
        else:
            docs.append(Doc(str(path), i, body))
    if not docs and not problems:
        problems.append(Problem("schema", str(path), "no Kubernetes object: the file is empty or holds only comments"))
    return docs, problems


# ---------------------------------------------------------------------- the schema

def schema_problems(doc: Doc, versions: Sequence[str] = VERSIONS) -> list[Problem]:
    """Strict validation against each Kubernetes version's schema (kubernetes-validate)."""
    try:
        import kubernetes_validate  # deferred: a test/dev dependency, not needed to write manifests
        from kubernetes_validate.utils import VersionNotSupportedError
    except ImportError:
        return [Problem("schema", doc.where, "the kubernetes-validate package is not installed "
                                             "(pip install -c requirements.lock kubernetes-validate)")]
    problems = []
    for version in versions:
        try:
            checked = kubernetes_validate.validate(doc.body, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(top level)"
            problems.append(Problem("schema", doc.where, f"Kubernetes {version} (strict): {path}: {e.message}"))
            continue
        except (kubernetes_validate.SchemaNotFoundError, VersionNotSupportedError,
                kubernetes_validate.InvalidSchemaError) as e:
            problems.append(Problem("schema", doc.where, f"Kubernetes {version}: {getattr(e, 'message', e)}"))
            continue
        if str(checked) != version:  # it falls back to the newest schema not newer than the one asked for
            problems.append(Problem("schema", doc.where, f"no schema for Kubernetes {version} (got {checked})"))
    return problems


# ---------------------------------------------------------------------- distlab's checks

def _dns_label(value, rule=DNS_LABEL_RE) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(rule.match(value))


def _labels_problems(labels, where: str, what: str) -> list[Problem]:
    out = []
    for key, value in (labels or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE_RE.match(value):
            out.append(Problem("names", where, f"{what} {key}={value!r} is not a valid label value"))
    return out


def name_problems(doc: Doc) -> list[Problem]:
    meta = doc.body.get("metadata") or {}
    name, out = meta.get("name"), []
    rule, what = (DNS_1035_RE, "a DNS-1035 label (starts with a letter)") if doc.kind == "Service" else \
        (DNS_LABEL_RE, "a DNS-1123 label")
    if not _dns_label(name, rule):
        out.append(Problem("names", doc.where, f"name {name!r} is not {what} of at most 63 characters"))
    if doc.namespace is not None and not _dns_label(doc.namespace):
        out.append(Problem("names", doc.where, f"namespace {doc.namespace!r} is not a DNS-1123 label"))
    out += _labels_problems(meta.get("labels"), doc.where, "label")
    template = ((doc.body.get("spec") or {}).get("template") or {}).get("metadata") or {}
    out += _labels_problems(template.get("labels"), doc.where, "pod label")
    return out


def _pod(doc: Doc) -> dict:
    return ((doc.body.get("spec") or {}).get("template") or {}).get("spec") or {}


def job_problems(job: Doc, services: dict[tuple[str | None, str], Doc]) -> list[Problem]:
    """Every own check of one Job; `services` maps (namespace, name) to the Services given."""
    spec, pod, where = job.body.get("spec") or {}, _pod(job), job.where
    labels = (((spec.get("template") or {}).get("metadata") or {}).get("labels")) or {}
    completions, parallelism = spec.get("completions"), spec.get("parallelism")
    out = []
    if spec.get("completionMode") != "Indexed":
        out.append(Problem("completion-mode", where, f"completionMode is {spec.get('completionMode')!r}, not "
                                                     "'Indexed': pods get no JOB_COMPLETION_INDEX and no stable name"))
    if not isinstance(completions, int) or isinstance(completions, bool) or completions < 1:
        out.append(Problem("parallelism", where, f"completions {completions!r}: one pod per node, at least 1"))
        completions = None
    elif parallelism != completions:
        out.append(Problem("parallelism", where, f"parallelism {parallelism!r} != completions {completions}: every "
                                                 "node's pod must run at once, or the rendezvous never completes"))
    if completions:
        host = f"{job.name}-{completions - 1}"
        if not _dns_label(host):
            out.append(Problem("pod-hostname", where, f"the last pod's host name {host!r} ({len(host)} characters) "
                                                      "is not a DNS label of at most 63 characters"))
    policy = pod.get("restartPolicy")
    if policy not in ("Never", "OnFailure"):
        out.append(Problem("restart-policy", where, f"restartPolicy {policy!r}: a Job's pods take Never or OnFailure"))
    elif policy == "OnFailure" and (completions or 0) > 1:
        out.append(Problem("restart-policy", where, "OnFailure restarts a failed container in place, where it cannot "
                                                    "rejoin a rendezvous the other pods have left: use Never"))
    subdomain = pod.get("subdomain")
    service = services.get((job.namespace, subdomain))
    if not subdomain:
        out.append(Problem("subdomain", where, "no subdomain: the pods get no DNS names (set it to the headless "
                                               "Service's name)"))
    elif service is None:
        out.append(Problem("subdomain", where, f"subdomain {subdomain!r} names no Service in namespace "
                                               f"{job.namespace!r} among the files checked"))
    else:
        selector = (service.body.get("spec") or {}).get("selector") or {}
        missing = {k: v for k, v in selector.items() if labels.get(k) != v}
        if not selector or missing:
            out.append(Problem("headless-service", where, f"Service {subdomain}'s selector {selector} does not match "
                                                          f"the pod labels {labels} (differs: {missing or 'empty'})"))
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    for c in containers:
        if not isinstance(c.get("image"), str) or not c["image"].strip():
            out.append(Problem("image", where, f"container {c.get('name')!r} has no image"))
    out += _master_problems(job, containers, subdomain, completions)
    out += _shm_problems(job, containers, pod)
    if labels.get(LABEL_RUN) != job.name:
        out.append(Problem("run-label", where, f"pod label {LABEL_RUN} is {labels.get(LABEL_RUN)!r}, not "
                                               f"{job.name!r}: the collector finds a run's pods by it"))
    return out


def _master_problems(job: Doc, containers: list, subdomain, completions) -> list[Problem]:
    out = []
    expected = f"{job.name}-0.{subdomain}"
    allowed = {expected, f"{expected}.{job.namespace}", f"{expected}.{job.namespace}.svc",
               f"{expected}.{job.namespace}.svc.cluster.local"}
    for c in containers:
        env = {e.get("name"): e.get("value") for e in c.get("env") or [] if isinstance(e, dict)}
        if "MASTER_ADDR" not in env:
            if (completions or 0) > 1:
                out.append(Problem("master-addr", job.where, f"container {c.get('name')!r} has no MASTER_ADDR "
                                                             f"(expected {expected!r})"))
            continue
        if env["MASTER_ADDR"] not in allowed:
            out.append(Problem("master-addr", job.where, f"MASTER_ADDR {env['MASTER_ADDR']!r} is not pod 0 of this "
                                                         f"Job through its Service, {expected!r}"))
        port = env.get("MASTER_PORT")
        if not (isinstance(port, str) and port.isdigit() and 1024 <= int(port) <= 65535):
            out.append(Problem("master-addr", job.where, f"MASTER_PORT {port!r} is not a port in 1024-65535"))
    return out


def _shm_problems(job: Doc, containers: list, pod: dict) -> list[Problem]:
    memory_volumes = {v.get("name") for v in pod.get("volumes") or []
                      if isinstance(v, dict) and (v.get("emptyDir") or {}).get("medium") == "Memory"}
    out = []
    for c in containers:
        mounts = [m for m in c.get("volumeMounts") or [] if isinstance(m, dict) and m.get("mountPath") == "/dev/shm"]
        if not mounts or mounts[0].get("name") not in memory_volumes:
            out.append(Problem("shm", job.where, f"container {c.get('name')!r}: /dev/shm is not an emptyDir with "
                                                 "medium: Memory (the runtime's default is 64 MiB)"))
    return out


def _containers(pod: dict) -> list[dict]:
    return [c for key in ("initContainers", "containers") for c in pod.get(key) or [] if isinstance(c, dict)]


def _quantity_ok(value) -> bool:
    """What KubeJob accepts for cpu, memory and shm_size (QUANTITY_RE), YAML numbers included."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return False
    return bool(QUANTITY_RE.match(str(value)))


def resource_problems(job: Doc) -> list[Problem]:
    """GPUs a whole number (an extended resource cannot be split), every other quantity as the generator's."""
    out, pod = [], _pod(job)
    for c in _containers(pod):
        resources = c.get("resources") or {}
        for kind in ("limits", "requests"):
            for name, value in (resources.get(kind) or {}).items():
                if name == GPU_RESOURCE:
                    whole = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or \
                        (isinstance(value, str) and value.isdigit())
                    if not whole:
                        out.append(Problem("resources", job.where, f"container {c.get('name')!r}: {kind} "
                                                                   f"{name} {show(value)} is not a whole number of "
                                                                   "GPUs"))
                elif not _quantity_ok(value):
                    out.append(Problem("resources", job.where, f"container {c.get('name')!r}: {kind} {name} "
                                                               f"{show(value)} is not a quantity (e.g. 8, 500m, 64Gi)"))
    for v in pod.get("volumes") or []:
        size = ((v.get("emptyDir") or {}) if isinstance(v, dict) else {}).get("sizeLimit")
        if size is not None and not _quantity_ok(size):
            out.append(Problem("resources", job.where, f"volume {v.get('name')!r}: sizeLimit {show(size)} is not a "
                                                       "quantity (e.g. 16Gi)"))
    return out


def secret_problems(job: Doc) -> list[Problem]:
    """The secret rule of every script writer (distlab.launch.shell): a secret comes from a Secret
    (valueFrom.secretKeyRef), never as a literal in a manifest that is committed and shared."""
    out = []
    for c in _containers(_pod(job)):
        where = f"container {c.get('name')!r}"
        for e in c.get("env") or []:
            if not isinstance(e, dict) or "value" not in e:
                continue  # valueFrom: the way to pass a secret
            name, value = str(e.get("name")), e.get("value")
            if looks_like_secret_name(name):
                out.append(Problem("secrets", job.where, f"{where}: env {name} has a literal value and looks like a "
                                                         "secret: take it from a Secret (valueFrom.secretKeyRef)"))
            elif isinstance(value, str) and looks_like_secret_value(value):
                out.append(Problem("secrets", job.where, f"{where}: env {name}'s value looks like a credential"))
        for key in ("command", "args"):
            if any(isinstance(w, str) and looks_like_secret_value(w) for w in c.get(key) or []):
                out.append(Problem("secrets", job.where, f"{where}: an item of {key} looks like a credential"))
    return out


def duplicate_problems(docs: Sequence[Doc]) -> list[tuple[Doc, Problem]]:
    """Every object after the first of its kind, namespace and name (kubectl would keep only the last)."""
    first: dict[tuple, Doc] = {}
    out = []
    for d in docs:
        key = (d.kind, d.namespace, d.name)
        if key in first:
            f = first[key]
            scope = f"namespace {d.namespace}" if d.namespace else "the cluster (or the default namespace)"
            out.append((d, Problem("duplicates", d.where, f"{scope} already has it from {f.file} (document "
                                                          f"{f.index + 1}); the later would replace it")))
        else:
            first[key] = d
    return out


def service_problems(doc: Doc) -> list[Problem]:
    spec = doc.body.get("spec") or {}
    out = []
    if spec.get("clusterIP") != "None":
        out.append(Problem("headless-service", doc.where, f"clusterIP is {spec.get('clusterIP')!r}, not 'None': "
                                                          "a Service with a virtual IP gives pods no DNS names"))
    if spec.get("publishNotReadyAddresses") is not True:
        out.append(Problem("headless-service", doc.where, "publishNotReadyAddresses is not true: pods would resolve "
                                                          "only once ready, after the rendezvous they wait in"))
    if not spec.get("selector"):
        out.append(Problem("headless-service", doc.where, "no selector: no pod gets a DNS record"))
    return out


# ---------------------------------------------------------------------- files

def validate_docs(docs: Sequence[Doc], versions: Sequence[str] = VERSIONS) -> dict[str, list[Problem]]:
    """Problems per file (every file present, [] when clean), checking the documents together."""
    services = {(d.namespace, d.name): d for d in docs if d.kind == "Service"}
    found: dict[str, list[Problem]] = {d.file: [] for d in docs}
    for d in docs:
        found[d.file] += schema_problems(d, versions) + name_problems(d)
        if d.kind == "Job":
            found[d.file] += job_problems(d, services) + resource_problems(d) + secret_problems(d)
        elif d.kind == "Service":
            found[d.file] += service_problems(d)
    for d, problem in duplicate_problems(docs):
        found[d.file].append(problem)
    return found


def validate_files(paths: Iterable[str | Path], versions: Sequence[str] = VERSIONS) -> dict[str, list[Problem]]:
    docs, found = [], {}
    for path in yaml_files(paths):
        file_docs, problems = load_docs(path)
        docs += file_docs
        found[str(path)] = problems
    for file, problems in validate_docs(docs, versions).items():
        found[file] += problems
    return found


def report(found: dict[str, list[Problem]], versions: Sequence[str] = VERSIONS) -> str:
    lines = []
    for file, problems in found.items():
        if problems:
            lines.append(f"FAIL {file}: {len(problems)} problem(s)")
            lines += [f"  {p}" for p in problems]
        else:
            lines.append(f"OK   {file}")
    bad = sum(1 for p in found.values() if p)
    lines.append(f"{len(found)} file(s): {len(found) - bad} OK, {bad} with problems. Schema: Kubernetes "
                 f"{' and '.join(versions)}, strict (kubernetes-validate); checks: {', '.join(CHECKS[1:])}.")
    return "\n".join(lines)


def main_validate(paths: Sequence[str], versions: Sequence[str] = VERSIONS) -> int:
    try:
        found = validate_files(paths, versions)
    except FileNotFoundError as e:
        print(e)
        return 2
    print(report(found, versions))
    return 1 if any(found.values()) else 0
