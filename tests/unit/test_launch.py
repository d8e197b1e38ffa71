"""distlab.launch: the spec's validation, the exact scripts it writes (golden files), their
quoting, that bash and shellcheck accept them (and run with a stand-in python, the quoted values arriving
verbatim), and that launch/ is what the generator writes. Real runs of generated scripts through
distlab.launch.process (torchrun on CPU, gloo): tests/launches/test_launch_runs.py.

Rewrite the golden files after an intended change with

    DISTLAB_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_launch.py
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from distlab.config import load_config
from distlab.launch import catalog, generated, torchrun
from distlab.launch.spec import LaunchSpec, LaunchSpecError
from distlab.paths import LAUNCH_DIR, REPO_ROOT

GOLDEN = Path(__file__).parents[1] / "golden" / "launch"
UPDATE = os.environ.get("DISTLAB_UPDATE_GOLDEN") == "1"

LAN = ["192.168.1.100", "192.168.1.101", "192.168.1.102"]

GOLDEN_SPECS = {
    # One machine, two CPU ranks: the tutorial's own DDP run.
    "tiny_ddp_cpu": LaunchSpec(
        args=["--config", "lib/distlab/configs/tiny_lora.yaml", "--set", "strategy=ddp", "--set", "max_steps=20"],
        nproc_per_node=2, env={"OMP_NUM_THREADS": "1"}, strategy="ddp", micro_batch_size=4,
        global_batch_size=8, log_dir="logs/tiny_ddp_cpu", timeout_s=900, repo_root="..",
        description="Tiny LoRA with DDP on 2 CPU ranks (gloo)"),
    # Two LAN nodes, one GPU each, static rendezvous at the master.
    "lan_static": LaunchSpec(
        args=["--config", "lib/distlab/configs/enterprise_7b_lora.yaml", "--set", "strategy=ddp",
              "--set", "max_steps=50"],
        nproc_per_node=1, nnodes=2, rendezvous="static", master_addr=LAN[0], master_port=29500,
        env={"OMP_NUM_THREADS": "1", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
             "NCCL_IB_DISABLE": "1"},
        strategy="ddp", micro_batch_size=2, global_batch_size=64, log_dir="logs/lan_static",
        timeout_s=3600, repo_root="..", hosts=LAN[:2],
        description="Enterprise LoRA demo on two LAN nodes"),
    # Three LAN nodes, elastic: c10d rendezvous, the group restarts up to 3 times.
    "lan_c10d": LaunchSpec(
        args=["--config", "lib/distlab/configs/enterprise_7b_lora.yaml", "--set", "max_steps=50"],
        nproc_per_node=1, nnodes=3, rendezvous="c10d", rdzv_endpoint=f"{LAN[0]}:29400",
        rdzv_id="distlab-lan", max_restarts=3, strategy="ddp",
        env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "false",
             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"},
        kill_after_s=90, log_dir="logs/lan_c10d", timeout_s=7200, hosts=LAN,
        description="Enterprise LoRA demo on three LAN nodes, restarting after a failure"),
}


def rendered(name: str) -> dict[str, str]:
    return torchrun.render_files(GOLDEN_SPECS[name], name)


def scripts_of(files: dict[str, str]) -> dict[str, str]:
    return {rel: text for rel, text in files.items() if rel.endswith(".sh")}


# ------------------------------------------------------------------ golden files

@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_rendered_files_match_golden(name):
    files = rendered(name)
    if UPDATE:
        shutil.rmtree(GOLDEN / name, ignore_errors=True)
        (GOLDEN / f"{name}.sh").unlink(missing_ok=True)
        for rel, text in files.items():
            (GOLDEN / rel).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / rel).write_text(text)
    for rel, text in files.items():
        golden = GOLDEN / rel
        assert golden.is_file(), f"{golden} missing: run with DISTLAB_UPDATE_GOLDEN=1"
        assert text == golden.read_text(), f"{rel} differs from {golden} (DISTLAB_UPDATE_GOLDEN=1 rewrites it)"


def test_layout_one_node_is_a_script_several_are_a_folder(tmp_path):
    one = torchrun.write_scripts(GOLDEN_SPECS["tiny_ddp_cpu"], tmp_path, "one")
    assert one == [tmp_path / "one.sh"]
    many = torchrun.write_scripts(GOLDEN_SPECS["lan_c10d"], tmp_path, "many")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in many) == \
        ["many/README.md", "many/node0.sh", "many/node1.sh", "many/node2.sh"]
    for p in one + many:
        executable = bool(p.stat().st_mode & stat.S_IXUSR)
        assert executable == (p.suffix == ".sh"), p


def test_node_scripts_differ_only_where_they_must():
    static = rendered("lan_static")
    n0, n1 = static["lan_static/node0.sh"].splitlines(), static["lan_static/node1.sh"].splitlines()
    diff = [(a, b) for a, b in zip(n0, n1) if a != b]
    assert len(n0) == len(n1) and len(diff) == 3  # the placement comment, the node's host, --node-rank
    assert diff[1] == ("node_rank=0 node_host=192.168.1.100", "node_rank=1 node_host=192.168.1.101")
    assert diff[2] == ("  --node-rank 0 \\", "  --node-rank 1 \\")
    readme = static["lan_static/README.md"]
    assert "| `node0.sh` | `192.168.1.100` (the master, listens on 29500) | 0 | global rank 0 |" in readme
    assert "nc -zv 192.168.1.100 29500" in readme and "distlab.workers.fingerprint" in readme
    c10d = rendered("lan_c10d")["lan_c10d/node2.sh"]
    assert "--rdzv-backend c10d" in c10d and "--node-rank" not in c10d and "--max-restarts 3" in c10d


def test_output_is_deterministic_and_machine_independent():
    for name in GOLDEN_SPECS:
        for text in rendered(name).values():
            assert str(REPO_ROOT) not in text and "/tmp" not in text and "/home" not in text
    assert rendered("lan_static") == rendered("lan_static")


# ------------------------------------------------------------------ validation

BASE = dict(nproc_per_node=2)
STATIC = dict(nnodes=2, rendezvous="static", master_addr="192.168.1.100")
C10D = dict(nnodes=2, rendezvous="c10d", rdzv_endpoint="192.168.1.100:29400")

INVALID = [
    ("node_rank", dict(STATIC, node_rank=2)),
    ("node_rank", dict(STATIC, node_rank=-1)),
    ("nproc_per_node", dict(nproc_per_node=0)),
    ("nproc_per_node", dict(nproc_per_node=True)),
    ("nnodes", dict(nnodes=0)),
    ("nnodes", dict(nnodes=2)),  # standalone on two nodes
    ("rendezvous", dict(rendezvous="etcd")),
    ("rendezvous", dict(master_addr="192.168.1.100")),  # standalone with a master
    ("master_addr", dict(STATIC, master_addr=None)),
    ("master_addr", dict(STATIC, master_addr="")),
    ("master_addr", dict(STATIC, master_addr="  ")),
    ("master_addr", dict(STATIC, master_addr="host; rm -rf /")),
    ("master_port", dict(STATIC, master_port=80)),
    ("master_port", dict(STATIC, master_port=65536)),
    ("rdzv_endpoint", dict(C10D, rdzv_endpoint=None)),
    ("rdzv_endpoint", dict(C10D, rdzv_endpoint=":29400")),
    ("rdzv_endpoint", dict(C10D, rdzv_endpoint="192.168.1.100")),
    ("rdzv_endpoint", dict(C10D, rdzv_endpoint="192.168.1.100:99999")),
    ("rdzv_endpoint", dict(C10D, rdzv_endpoint="192.168.1.100:http")),
    ("rdzv_id", dict(C10D, rdzv_id="my job")),
    ("max_restarts", dict(max_restarts=-1)),
    ("max_restarts", dict(STATIC, max_restarts=2)),  # static cannot re-form across nodes
    ("timeout_s", dict(timeout_s=0)),
    ("kill_after_s", dict(kill_after_s=10)),  # shorter than torchrun's 30 s shutdown
    ("kill_after_s", dict(kill_after_s=60, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"})),
    ("strategy", dict(strategy="tensor")),
    ("strategy", dict(strategy="single")),  # world 2
    ("strategy", dict(strategy="ddp", args=["--set", "strategy=fsdp"])),
    ("args", dict(args=["--set", "strategy=magic"])),
    ("pipeline_stages", dict(nproc_per_node=4, strategy="pipeline")),
    ("pipeline_stages", dict(nproc_per_node=4, strategy="pipeline", pipeline_stages=3)),
    ("pipeline_stages", dict(strategy="ddp", pipeline_stages=2)),
    ("global_batch_size", dict(nproc_per_node=3, strategy="ddp", global_batch_size=64, micro_batch_size=2)),
    ("global_batch_size", dict(nproc_per_node=4, strategy="pipeline", pipeline_stages=2,
                               global_batch_size=6, micro_batch_size=2)),
    ("micro_batch_size", dict(global_batch_size=64)),
    ("env", dict(env={"1BAD": "x"})),
    ("env", dict(env={"NOT-A-NAME": "x"})),
    ("env", dict(env={"A B": "x"})),
    ("env", dict(env={"OMP_NUM_THREADS": "1\nrm -rf /"})),
    ("env", dict(env={"OMP_NUM_THREADS": "1\0"})),
    ("env", dict(env={"OMP_NUM_THREADS": 1})),
    ("env", dict(env={"RANK": "0"})),
    ("env", dict(env={"PYTHON": "python3"})),
    ("env", dict(env={"PATH": "/usr/bin"})),
    ("env", dict(env={"HF_TOKEN": "x"})),
    ("env", dict(env={"WANDB_API_KEY": "x"})),
    ("env", dict(env={"AWS_SECRET_ACCESS_KEY": "x"})),
    ("env", dict(env={"DB_PASSWORD": "x"})),
    ("env", dict(env={"GITHUBTOKEN": "x"})),
    ("env", dict(env={"HUB_CREDENTIALS": "x"})),
    ("env", dict(env={"SOME_SETTING": "hf_" + "a" * 34})),  # a credential under an innocent name
    ("env_notes", dict(env_notes={"NCCL_DEBUG": "not in env"})),
    ("args", dict(args=["--set", "model=x\ny"])),
    ("args", dict(args=["--token", "ghp_" + "b" * 36])),
    ("args", dict(args=["--config", 3])),
    ("module", dict(module="distlab/train.py")),
    ("module", dict(module="")),
    ("log_dir", dict(log_dir="")),
    ("python", dict(python="")),
    ("repo_root", dict(repo_root="/work/main")),
    ("hosts", dict(STATIC, hosts=["192.168.1.100"])),
    ("hosts", dict(STATIC, hosts=["192.168.1.101", "192.168.1.100"])),  # node 0 is not the master
    ("hosts", dict(C10D, hosts=["192.168.1.101", "192.168.1.102"])),
]


@pytest.mark.parametrize("field,changes", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_specs_name_the_field(field, changes):
    with pytest.raises(LaunchSpecError) as err:
        LaunchSpec(**{**BASE, **changes})
    assert err.value.field == field
    assert f"LaunchSpec.{field}:" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_invalid_after_construction_is_caught_when_rendering():
    spec = LaunchSpec(**BASE)
    spec.nproc_per_node = 0
    with pytest.raises(LaunchSpecError, match="nproc_per_node"):
        torchrun.render_script(spec)
    with pytest.raises(LaunchSpecError, match="name"):
        torchrun.render_files(LaunchSpec(**BASE), "../escape")


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "NCCL_SOCKET_IFNAME", "NCCL_IB_PKEY", "MONKEY_PATCH",
                                  "KEYBOARD_LAYOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HF_HOME", "lower_case"])
def test_ordinary_names_are_not_mistaken_for_secrets(name):
    LaunchSpec(**BASE, env={name: "1"})


def test_valid_edge_cases():
    LaunchSpec(nproc_per_node=1, strategy="single")  # single: world 1
    LaunchSpec(nproc_per_node=4, nnodes=2, rendezvous="c10d", rdzv_endpoint="[::1]:29400", strategy="pipeline",
               pipeline_stages=4, global_batch_size=8, micro_batch_size=4)  # data-parallel size 2
    spec = LaunchSpec(nproc_per_node=2, args=["--set", "strategy=ddp"])
    assert spec.effective_strategy == "ddp"
    assert LaunchSpec(**STATIC, master_port=1024).for_node(1).node_rank == 1


# ------------------------------------------------------------------ bash, shellcheck, quoting

NASTY = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED2`", "$HOME", "back\\slash", "*",
         "; touch PWNED3", "!!", "", "tab\there", "{a,b}", "~", "ünïcode", "--set", "x=$((1+1))"]
NASTY_ENV = "$(touch PWNED4) `touch PWNED5` 'single' \"double\" $HOME * ;|&"


def nasty_spec(python: str = "python", log_dir: str = "logs/with space $(touch PWNED6)") -> LaunchSpec:
    return LaunchSpec(module="some.entry", args=list(NASTY), nproc_per_node=2, python=python,
                      env={"DISTLAB_NASTY": NASTY_ENV}, env_notes={"DISTLAB_NASTY": "quoting test"},
                      log_dir=log_dir, timeout_s=60, description="quoting $(touch PWNED7) `x`")


@pytest.fixture(scope="module")
def shellcheck():
    tool = REPO_ROOT / "tools" / "ensure_debian_packages.sh"
    proc = subprocess.run(["bash", str(tool), "shellcheck:shellcheck"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not shutil.which("shellcheck"):
        reason = f"shellcheck unavailable: {proc.stderr.strip() or proc.stdout.strip()}"
        print(reason)
        pytest.skip(reason)
    return shutil.which("shellcheck")


def all_scripts(tmp_path: Path) -> list[Path]:
    paths = []
    for name in GOLDEN_SPECS:
        paths += [p for p in torchrun.write_scripts(GOLDEN_SPECS[name], tmp_path / "golden", name) if p.suffix == ".sh"]
    paths += torchrun.write_scripts(nasty_spec(), tmp_path, "nasty")
    paths += torchrun.write_scripts(nasty_spec(python="/opt/odd dir/$(x)/py"), tmp_path, "nasty_python")
    paths += sorted(LAUNCH_DIR.rglob("*.sh"))
    return paths


def test_every_script_passes_bash_n_and_shellcheck(tmp_path, shellcheck):
    scripts = all_scripts(tmp_path)
    assert len(scripts) >= 10
    for path in scripts:
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{path}: {syntax.stderr}"
    lint = subprocess.run([shellcheck, "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def exec_command(script: str) -> list[str]:
    """The words of the script's final `exec ...` command, continuation lines joined."""
    text = script[script.index("\nexec ") + 1:].replace("\\\n", " ")
    return shlex.split(text)


def test_quoting_round_trips_through_shlex():
    script = torchrun.render_script(nasty_spec())
    words = exec_command(script)
    # The hard limit is distlab's watchdog (no GNU `timeout`: macOS lacks it), run by the same interpreter.
    assert words[:9] == ["exec", "$PYTHON", "-m", "distlab.launch.watchdog", "--timeout-s", "60", "--kill-after-s",
                         "60", "--"]
    assert words[9:12] == ["$PYTHON", "-m", "torch.distributed.run"]  # "$PYTHON" stays a quoted expansion
    assert words[-len(NASTY) - 2:] == ["-m", "some.entry", *NASTY]
    assert words[words.index("--log-dir") + 1] == "logs/with space $(touch PWNED6)"
    export = next(ln for ln in script.splitlines() if ln.startswith("export DISTLAB_NASTY="))
    assert shlex.split(export) == ["export", f"DISTLAB_NASTY={NASTY_ENV}"]


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the interpreter: records what it was given, as NUL-separated words.
printf '%s\\0' "$0" "$@" > "$FAKE_OUT"
printf '%s' "$DISTLAB_NASTY" > "$FAKE_OUT.env"
"""


def fake_python(folder: Path) -> Path:
    folder.mkdir(parents=True)
    py = folder / "py"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    return py


def run_fake(script: Path, cwd: Path, out: Path, python_override: Path | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["FAKE_OUT"] = str(out)
    if python_override:
        env["PYTHON"] = str(python_override)
    proc = subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return out.read_text().split("\0")[:-1]


def test_quoted_values_reach_the_program_verbatim(tmp_path):
    """Run a generated script for real, with a stand-in interpreter whose own path needs quoting:
    every argument, the env value and the log folder arrive byte for byte, nothing is executed."""
    odd = fake_python(tmp_path / "odd dir $(touch PWNED8) `touch PWNED9` 'q'")
    spec = nasty_spec(python=str(odd))
    script = torchrun.write_scripts(spec, tmp_path / "scripts", "nasty")[0]
    work = tmp_path / "work"
    work.mkdir()
    argv = run_fake(script, work, tmp_path / "argv")
    assert argv[0] == str(odd)  # the spec's interpreter, found through its odd path
    assert argv[1:8] == ["-m", "distlab.launch.watchdog", "--timeout-s", "60", "--kill-after-s", "60", "--"]
    assert argv[8:] == [str(odd), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                        "--max-restarts", "0", "--standalone", "--signals-to-handle",
                        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--log-dir", "logs/with space $(touch PWNED6)",
                        "--tee", "3", "-m", "some.entry", *NASTY]
    assert (tmp_path / "argv.env").read_text() == NASTY_ENV
    assert (work / "logs" / "with space $(touch PWNED6)").is_dir()
    # $PYTHON from the caller's environment wins over the spec's interpreter.
    other = fake_python(tmp_path / "other")
    assert run_fake(script, work, tmp_path / "argv2", python_override=other)[0] == str(other)
    assert not [p for p in tmp_path.rglob("PWNED*")] and not list(Path.cwd().glob("PWNED*"))


# ------------------------------------------------------------------ launch/ and the case studies' matrix

def test_checked_in_launch_folder_matches_the_writer():
    problems = generated.check_dir(LAUNCH_DIR, catalog.launch_files())
    assert problems == [], "launch/ is stale; run `python -m distlab.launch regenerate`:\n" + "\n".join(problems)


def test_check_reports_every_kind_of_difference_and_regenerate_repairs(tmp_path, capsys):
    root = tmp_path / "launch"
    files = catalog.launch_files()
    generated.regenerate(root, files)
    assert catalog.main(["check", "--dir", str(root)]) == 0
    (root / "run_4gpu.sh").write_text((root / "run_4gpu.sh").read_text().replace("150", "151"))
    (root / "run_1gpu.sh").chmod(0o644)
    (root / "run_2node_8gpu" / "node1.sh").unlink()
    (root / "old_run.sh").write_text(f"# {generated.GENERATED_MARK}\n")
    (root / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert catalog.main(["check", "--dir", str(root)]) == 1
    out = capsys.readouterr().out
    for expected in ["run_4gpu.sh: differs", "run_1gpu.sh: should be executable", "run_2node_8gpu/node1.sh: missing",
                     "old_run.sh: not produced", "notes.txt: not produced"]:
        assert expected in out
    assert catalog.main(["regenerate", "--dir", str(root)]) == 0
    assert generated.check_dir(root, files) == [
        "notes.txt: not produced by the generator (hand-written? delete it, or move it out: regenerate keeps it)"]
    assert not (root / "old_run.sh").exists() and (root / "notes.txt").exists()


def test_seed_matrix_follows_the_enterprise_and_lan_seeds():
    rows = {row.name: row for row in catalog.DEMO_MATRIX}
    assert {n: (r.nnodes, r.gpus_per_node, r.max_steps) for n, r in rows.items()} == {
        "run_1gpu": (1, 1, 80), "run_4gpu": (1, 4, 150), "run_2node_8gpu": (2, 4, 200)}
    files = catalog.launch_files()  # launch/k8s/ is tested in test_kubernetes.py, launch/slurm/ in test_slurm.py
    assert sorted(f for f in files if not f.startswith(("k8s/", "slurm/"))) == [
        "README.md", "run_1gpu.sh", "run_2node_8gpu/README.md", "run_2node_8gpu/node0.sh", "run_2node_8gpu/node1.sh",
        "run_4gpu.sh"]
    for name, row in rows.items():
        spec = catalog.demo_spec(row)
        assert spec.args[:6] == ["--config", "lib/distlab/configs/enterprise_7b_lora.yaml", "--set", "strategy=ddp",
                                 "--set", f"max_steps={row.max_steps}"]
        assert spec.log_dir.startswith("logs/")
        assert f"[`{name}" in files["README.md"]
    # The README names the file that holds DEMO_MATRIX: it must be that file.
    assert "DEMO_MATRIX" in (REPO_ROOT / catalog.GENERATOR_FILE).read_text()
    assert f"`{catalog.GENERATOR_FILE}`" in files["README.md"]
    two = catalog.demo_spec(rows["run_2node_8gpu"])
    assert (two.rendezvous, two.master_addr, two.master_port) == ("static", "192.168.1.100", 29500)
    assert two.env["NCCL_SOCKET_IFNAME"] == "eth0" and two.env["NCCL_IB_DISABLE"] == "1"
    assert "cd -- \"$(dirname -- \"${BASH_SOURCE[0]}\")\"/../..\n" in files["run_2node_8gpu/node0.sh"]
    assert "cd -- \"$(dirname -- \"${BASH_SOURCE[0]}\")\"/..\n" in files["run_4gpu.sh"]


def test_enterprise_config_loads_with_the_seed_defaults():
    cfg = load_config(REPO_ROOT / "lib" / "distlab" / "configs" / "enterprise_7b_lora.yaml")
    assert (cfg.model, cfg.dtype, cfg.device, cfg.seq_len) == ("Qwen/Qwen2.5-7B-Instruct", "bf16-autocast", "cuda",
                                                               1024)
    assert (cfg.lora, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (True, 16, 32, 0.05)
    assert cfg.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (cfg.global_batch_size, cfg.micro_batch_size, cfg.lr, cfg.weight_decay) == (64, 2, 2e-4, 0.01)
    assert (cfg.warmup_steps, cfg.max_grad_norm, cfg.logging_steps) == (20, 1.0, 5)
    assert cfg.output_dir == "build/runs/enterprise_7b"
    assert [cfg.micro_steps(w) for w in (1, 4, 8)] == [32, 8, 4]  # the enterprise assistant's 8 on 4 GPUs
