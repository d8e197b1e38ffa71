"""Hostile values in every string field of every spec a script writer takes (LaunchSpec, SlurmSpec with
its Container, KubeJob with its LaunchSpec): each case is either refused with one line naming the spec
and the field, or written into scripts that parse (`bash -n`) and that, run for real with the programs
they start (python, srun, scontrol, apptainer, ...) replaced by stubs on PATH that only record their
argv and environment, execute nothing of the payload: no PWNED file appears, and a payload that reaches
a command line arrives there literally.

The fields are found by dataclass introspection (typing.get_type_hints), so a field added to a spec is
fed the corpus without being listed here; a field of a type this test cannot fill fails the test.
"""

from __future__ import annotations

import dataclasses
import subprocess
import types
import typing
from pathlib import Path
from typing import Callable

from distlab.launch import sbatch, torchrun
from distlab.launch.kubernetes import manifests
from distlab.launch.sbatch import Container, SlurmSpec
from distlab.launch.shell import SpecError
from distlab.launch.spec import LaunchSpec

CORPUS = {
    "newline": "a\ntouch PWNED",
    "crlf": "a\r\ntouch PWNED",
    "cr": "a\rtouch PWNED",
    "subst": "$(touch PWNED)",
    "backticks": "`touch PWNED`",
    "single-quote": "x'; touch PWNED; '",
    "double-quote": 'x"; touch PWNED; "',
    "ifs": "x${IFS}touch${IFS}PWNED",
    "semicolon": "a; touch PWNED",
    "and": "a && touch PWNED",
    "pipe": "a | touch PWNED",
    "nul": "a\0touch PWNED",
    "escape": "a\x1b]0;touch PWNED\x07",
    "del": "a\x7f",
    "vertical-tab": "a\x0btouch PWNED",
    "line-separator": "a\u2028touch PWNED",
    "long": "x" * 100_000,
    "hf-token": "hf_" + "A1b2C3d4" * 5,
}
REFUSED_EVERYWHERE = {"newline", "crlf", "cr", "nul", "escape", "del", "vertical-tab", "line-separator", "long",
                      "hf-token"}
STUB = """#!/bin/bash
# Records how it was started (argv, environment), then exits 0: the program a script would have run.
f="$(mktemp "$STUB_DIR/call.XXXXXX")"
printf '%s\\0' "$0" "$@" > "$f"
env -0 > "$f.env"
"""
SRUN = STUB + """while [[ "${1:-}" == --* ]]; do shift; done
exec "$@"  # the task itself (bash run.sh, or the container runtime)
"""
RUNTIME = STUB + """# apptainer/singularity exec ... IMAGE bash /app/<script>: the task on the host, /app = DISTLAB_ROOT
while [[ $# -gt 0 && "$1" != bash ]]; do shift; done
script="$2"
shift 2
exec bash "$DISTLAB_ROOT/${script#/app/}" "$@"
"""
SCONTROL = """#!/bin/bash
case "$2" in hostnames) echo node1 ;; node) echo "NodeName=node1 NodeAddr=127.0.0.1 State=IDLE" ;; esac
"""
STUB_NAMES = ("python", "python3", "sbatch", "torchrun")


# ------------------------------------------------------------------ the specs and their writers

@dataclasses.dataclass
class Target:
    label: str  # "LaunchSpec/static"
    build: Callable[[dict], object]  # kwargs -> the spec (raises its SpecError)
    base: dict  # a valid spec's fields, every optional string field set
    render: Callable[[object], dict[str, str]]  # spec -> relative path: text
    run: list[str] | None  # scripts to execute (relative paths), None: render and bash -n only
    nested: dict[str, type] = dataclasses.field(default_factory=dict)  # field -> dataclass filled field by field


ENV = {"DISTLAB_HOSTILE": "1"}
NOTES = {"DISTLAB_HOSTILE": "why it is set"}
LAUNCH_ONE = dict(module="some.entry", args=["--config", "c.yaml"], nproc_per_node=2, env=ENV, env_notes=NOTES,
                  log_dir="logs/x", timeout_s=60, description="d", repo_root=".", network="lan-ethernet",
                  strategy="ddp", python="python")
LAUNCH_STATIC = dict(LAUNCH_ONE, nnodes=2, rendezvous="static", master_addr="10.0.0.1", hosts=["10.0.0.1", "h2"])
LAUNCH_C10D = dict(LAUNCH_ONE, nnodes=2, rendezvous="c10d", rdzv_endpoint="10.0.0.1:29400", rdzv_id="job",
                   hosts=["10.0.0.1", "h2"])
SLURM = dict(name="job", module="some.entry", args=["--batch-size", "2"], partition="debug", model_dir="models/m",
             model_arg="--model", out_dir="out", time="00:10:00", log_dir="logs/slurm", env=ENV, script_dir="jobs/j",
             description="d")
CONTAINER = dict(image="images/x.sif", runtime="apptainer", gpu_flag="--nv", workspace="build/workspace")
KUBE = dict(name="job", image="registry.example.com/x:1", namespace="ns", service="bench", cpu="8", memory="64Gi",
            shm_size="16Gi")


def _kube_build(kwargs: dict) -> manifests.KubeJob:
    kwargs = dict(kwargs)
    # as kube_spec(), at the base's name: the Job's own validation then sees a hostile name or service
    master = manifests.master_host(KUBE["name"], KUBE["service"])
    spec = LaunchSpec(**{"rendezvous": "static", "master_addr": master, **kwargs.pop("spec")})
    return manifests.KubeJob(spec=spec, **kwargs)


def _slurm_build(kwargs: dict) -> SlurmSpec:
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("container"), dict):
        kwargs["container"] = Container(**kwargs["container"])
    return SlurmSpec(**kwargs)


KUBE_LAUNCH = {k: v for k, v in LAUNCH_ONE.items() if k != "repo_root"}  # the image's working directory
KUBE_LAUNCH["nnodes"] = 2
TARGETS = [
    Target("LaunchSpec/one-node", lambda kw: LaunchSpec(**kw), LAUNCH_ONE,
           lambda s: torchrun.render_files(s, "hostile"), ["hostile.sh"]),
    Target("LaunchSpec/static", lambda kw: LaunchSpec(**kw), LAUNCH_STATIC,
           lambda s: torchrun.render_files(s, "hostile"), ["hostile/node0.sh", "hostile/node1.sh"]),
    Target("LaunchSpec/c10d", lambda kw: LaunchSpec(**kw), LAUNCH_C10D,
           lambda s: torchrun.render_files(s, "hostile"), None),
    Target("SlurmSpec", _slurm_build, SLURM, sbatch.render_files, ["submit.sbatch"]),
    Target("SlurmSpec/container", _slurm_build, dict(SLURM, container=CONTAINER), sbatch.render_files,
           ["submit.sbatch"], nested={"container": Container}),
    Target("KubeJob", _kube_build, dict(KUBE, spec=KUBE_LAUNCH), lambda j: manifests.render_files([j]),
           ["entrypoints/job.sh"], nested={"spec": LaunchSpec}),
]


def _is_dataclass_type(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _slots(cls: type, base: dict, nested: dict[str, type]) -> list[tuple[str, Callable[[str], dict]]]:
    """(field, payload -> the base's kwargs with that field holding the payload) for every string field."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in base:  # a default: the target where the field means something fills it
            continue
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)] if isinstance(t, types.UnionType) else [t]
        t = args[0] if len(args) == 1 else t
        origin = typing.get_origin(t)
        if t is str:
            out.append((f.name, lambda p, n=f.name: {**base, n: p}))
        elif origin is list and typing.get_args(t) == (str,):
            def in_list(p, n=f.name):
                items = list(base.get(n) or [])
                return {**base, n: items[:-1] + [p] if items else [p]}  # a list of fixed length keeps it
            out.append((f.name, in_list))
        elif origin is dict and typing.get_args(t) == (str, str):
            out.append((f"{f.name}[value]",
                        lambda p, n=f.name: {**base, n: {k: p for k in base.get(n) or {"DISTLAB_HOSTILE": ""}}}))
            out.append((f"{f.name}[key]", lambda p, n=f.name: {**base, n: {**(base.get(n) or {}), p: "1"}}))
        elif f.name in nested:
            inner = base[f.name]
            for name, make in _slots(nested[f.name], inner, {}):
                out.append((f"{f.name}.{name}", lambda p, n=f.name, m=make: {**base, n: m(p)}))
        elif _is_dataclass_type(t) or "str" in str(hints[f.name]):
            raise AssertionError(f"{cls.__name__}.{f.name}: {hints[f.name]} holds strings this test cannot fill")
    return out




def _all_slots():
    for target in TARGETS:
        for field, make in _slots(type(target.build(target.base)), target.base, target.nested):
            yield target, field, make


SLOTS = list(_all_slots())
# Which recorded word a payload must reach verbatim (EXACT: as a whole word) or may not reach at all
# (INERT: comments, README text, values no program is given in this layout); any other field reaches a
# word as part of it (a path, --output=...) or names a folder the script creates.
EXACT = {"args", "module", "model_arg", "env[value]", "image"}
INERT = {"description", "env_notes[value]", "env_notes[key]", "env[key]", "repo_root", "hosts", "network", "strategy",
         "rdzv_id", "rendezvous"}


def _string_fields(cls: type) -> set[str]:
    hints = typing.get_type_hints(cls)
    return {f.name for f in dataclasses.fields(cls) if "str" in str(hints[f.name])}


def test_every_string_field_of_every_spec_is_fed_the_corpus():
    covered: dict[type, set[str]] = {}
    for target, field, _ in SLOTS:
        cls = type(target.build(target.base))
        name = field.split("[")[0]
        if "." in name:
            outer, inner = name.split(".")
            covered.setdefault(target.nested[outer], set()).add(inner)
        covered.setdefault(cls, set()).add(name.split(".")[0])
    for cls in (LaunchSpec, SlurmSpec, Container, manifests.KubeJob):
        assert _string_fields(cls) <= covered.get(cls, set()), (cls, _string_fields(cls) - covered.get(cls, set()))


def _run_env(root: Path, bin_dir: Path) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "STUB_DIR": str(root / ".calls"),
            "DISTLAB_SKIP_HOST_CHECK": "1", "DISTLAB_ROOT": str(root), "SLURM_SUBMIT_DIR": str(root),
            "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "node1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
            "JOB_COMPLETION_INDEX": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _recorded(root: Path) -> tuple[list[str], list[str]]:
    """Every argv word and every environment value the stubs recorded under root."""
    words, values = [], []
    for call in sorted((root / ".calls").glob("call.??????")):
        words += call.read_bytes().decode().split("\0")[:-1]
        values += [v.partition("=")[2] for v in (call.with_name(call.name + ".env").read_bytes().decode()
                                                  .split("\0")[:-1])]
    return words, values


def test_hostile_corpus_is_refused_or_inert_in_every_writer(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {**dict.fromkeys(STUB_NAMES, STUB), "srun": SRUN, "scontrol": SCONTROL,
                       "apptainer": RUNTIME, "singularity": RUNTIME}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    refused, accepted, written, runs = 0, 0, [], []
    for target, field, make in SLOTS:
        for payload_name, payload in CORPUS.items():
            case = f"{target.label} {field} <- {payload_name}"
            try:
                spec = target.build(make(payload))
                files = target.render(spec)
            except SpecError as err:
                refused += 1
                message = str(err)
                assert "\n" not in message and "\r" not in message and len(message) < 400, (case, message[:500])
                parts = field.replace("[", ".").split(".")
                assert err.field in {field.split("[")[0], parts[0], parts[-2] if "[" in field else parts[-1]}, \
                    (case, message)
                assert message.startswith(f"{type(err).spec}.{err.field}: "), (case, message)
                continue
            assert payload_name not in REFUSED_EVERYWHERE, f"{case}: accepted"
            accepted += 1
            root = tmp_path / f"case{len(written)}"
            base = root / spec.script_dir if isinstance(spec, SlurmSpec) else root
            for rel, text in files.items():
                (base / rel).parent.mkdir(parents=True, exist_ok=True)
                (base / rel).write_text(text)
            written += [base / rel for rel in files if rel.endswith((".sh", ".sbatch"))]
            if target.run:
                runs.append((case, field, payload, spec, root, [base / r for r in target.run]))
    # bash -n on every script written, in a few batched calls
    for i in range(0, len(written), 200):
        batch = subprocess.run(["bash", "-c", 'for f; do bash -n "$f" 2>&1 || echo "BAD $f"; done', "_",
                                *map(str, written[i:i + 200])], capture_output=True, text=True, timeout=120)
        assert batch.stdout == "" and batch.returncode == 0, batch.stdout[:2000]
    # ... and run them, with every program they start replaced by a stub
    for case, field, payload, spec, root, scripts in runs:
        (root / ".calls").mkdir()
        if field.endswith("repo_root"):
            (root / payload).mkdir(parents=True, exist_ok=True)
        if isinstance(spec, SlurmSpec):
            (root / spec.model_dir).mkdir(parents=True, exist_ok=True)
            (root / spec.model_dir / "config.json").write_text("{}")
        if field.endswith("python"):  # the interpreter named by the payload itself, found on PATH
            (bin_dir / payload).write_text(STUB)
            (bin_dir / payload).chmod(0o755)
        for script in scripts:
            proc = subprocess.run(["bash", str(script)], cwd=root, env=_run_env(root, bin_dir), capture_output=True,
                                  text=True, timeout=30)
            assert proc.returncode == 0, (case, script.name, proc.stderr[-2000:])
        assert not list(root.rglob("PWNED")) and not (bin_dir / "PWNED").exists(), f"{case}: the payload ran"
        words, values = _recorded(root)
        assert words, f"{case}: no program was started"
        key = field.split(".")[-1]
        if key in EXACT:
            assert payload in words + values, f"{case}: not one literal word: {words}"
        elif key not in INERT:
            # in a word (part of a path or option), or the folder the script created under that very name
            assert any(payload in w for w in words + values) or (root / payload).exists(), \
                f"{case}: did not arrive literally: {words}"
    total = len(SLOTS) * len(CORPUS)
    print(f"{len(SLOTS)} fields x {len(CORPUS)} payloads = {total} cases: {refused} refused, {len(written)} scripts "
          f"written and bash -n checked, {len(runs)} cases run against stubs, none executed a payload")
    assert refused + accepted == total and len(SLOTS) >= 60 and runs
