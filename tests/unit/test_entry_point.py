"""`python -m distlab <command>`: the one entry point of the user's commands. Its listing names every command
(every module of distlab.commands, so a new one cannot be left out), an unknown command is one line and exit 2,
and a command run through it prints, exits and fails exactly as its own main() does."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

from distlab import __main__ as entry
from distlab.paths import REPO_ROOT

COMMANDS_DIR = REPO_ROOT / "lib" / "distlab" / "commands"
PLAN_ARGS = ["--config", "lib/distlab/configs/lan_qlora_7b.yaml", "--devices", "A:8,B:24"]  # offline, torch-free


def distlab(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def listing() -> dict[str, str]:
    """`python -m distlab --help`'s commands: name -> description."""
    proc = distlab("--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: python -m distlab COMMAND"), proc.stdout
    blocks = [proc.stdout.split(f"{heading}:\n", 1)[1].split("\n\n", 1)[0] for heading in ("commands", "programs")]
    return dict(line.strip().split(maxsplit=1) for block in blocks for line in block.splitlines())


def test_the_listing_names_every_command_and_every_module_of_distlab_commands(listing):
    modules = {p.stem for p in COMMANDS_DIR.glob("*.py")} - {"__init__"}
    assert set(entry.COMMANDS) == modules, "register each module of distlab/commands in distlab.__main__.COMMANDS"
    assert list(listing) == [*entry.COMMANDS, *entry.PROGRAMS]
    assert entry.LAUNCHES_JOBS <= set(entry.COMMANDS)


@pytest.mark.parametrize("name", sorted(entry.COMMANDS))
def test_each_description_is_the_first_line_of_its_module_docstring(name, listing):  # programs: their own text
    assert entry.COMMANDS[name] == f"distlab.commands.{name}"
    tree = ast.parse((COMMANDS_DIR / f"{name}.py").read_text())
    first = (ast.get_docstring(tree) or "").split("\n", 1)[0].strip()
    assert first and listing[name] == first.rstrip("."), f"{name}: its docstring's first line describes it"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{name}: no main(argv)"
    assert 'if __name__ == "__main__"' not in (COMMANDS_DIR / f"{name}.py").read_text(), \
        f"{name}: runs as `python -m distlab {name}` only (distlab/__main__.py)"


def test_the_readme_shows_the_listing(listing):
    readme = (REPO_ROOT / "README.md").read_text()
    assert "python -m distlab --help" in readme
    missing = [name for name, text in listing.items() if f"  {name:<9}  {text}" not in readme]
    assert missing == [], f"README.md's copy of `python -m distlab --help` lacks {missing}"


@pytest.mark.parametrize("module", entry.OTHER_PROGRAMS)
def test_the_other_programs_named_in_the_listing_run_as_modules(module):
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    if spec.submodule_search_locations:  # a package: runs through its __main__.py
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module
    else:
        assert 'if __name__ == "__main__"' in open(spec.origin).read(), module


@pytest.mark.parametrize("argv,said", [(["frobnicate"], "unknown command 'frobnicate'"), ([], "no command given"),
                                       (["--debug"], "no command given"), (["Plan"], "unknown command 'Plan'")])
def test_an_unknown_command_is_one_line_naming_the_valid_ones_exit_2(argv, said):
    proc = distlab(*argv)
    assert proc.returncode == 2 and proc.stdout == ""
    names = ", ".join([*entry.COMMANDS, *entry.PROGRAMS])
    assert proc.stderr.splitlines() == [f"python -m distlab: error: {said}; one of {names} "
                                        f"(see python -m distlab --help)"]


@pytest.mark.parametrize("name", sorted(entry.COMMANDS))
def test_each_commands_help_through_the_entry_point_is_its_own(name, capsys):
    """In process (an interpreter start each would pay torch's import seven times)."""
    with pytest.raises(SystemExit) as own:
        importlib.import_module(f"distlab.commands.{name}").main(["--help"])
    expected = capsys.readouterr().out
    with pytest.raises(SystemExit) as through:
        entry.main([name, "--help"])
    out = capsys.readouterr()
    assert own.value.code == through.value.code == 0
    assert out.out == expected and out.err == ""
    assert expected.startswith(f"usage: python -m distlab {name} ")


@pytest.mark.slow  # an interpreter that imports torch: ~3 s
def test_a_command_prints_the_same_through_the_entry_point(capsys):
    from distlab.commands import plan  # deferred: what the subprocess below runs, imported only by this test

    assert plan.main(PLAN_ARGS) == 0
    expected = capsys.readouterr().out
    proc = distlab("plan", *PLAN_ARGS)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == expected


def test_a_commands_errors_and_debug_keep_their_form(tmp_path):
    missing = tmp_path / "missing.yaml"
    proc = distlab("plan", "--config", missing)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"python -m distlab plan: error: {missing}: cannot read the config file: "
                                        "No such file or directory"]
    proc = distlab("plan", "--no-such-flag")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["python -m distlab plan: error: the following arguments are required: "
                                        "--config (see python -m distlab plan --help)"]
    proc = distlab("--debug", "plan", "--config", missing)  # --debug before the command reaches it too
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "cannot read the config file" in proc.stderr


@pytest.mark.slow  # two interpreters, the command's and the one it monitors: ~2.5 s
def test_a_commands_exit_status_passes_through(tmp_path):
    proc = distlab("monitor", "--out", tmp_path, "--quiet", "--interval-s", "0.2", "--",
                   sys.executable, "-c", "raise SystemExit(3)")
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "monitor.csv").exists()


@pytest.mark.parametrize("name", sorted(entry.PROGRAMS))
def test_each_program_runs_through_the_entry_point_as_through_its_own_module(name, capsys):
    """`python -m distlab train --help` is `python -m distlab.train --help` but for the program's name."""
    main = importlib.import_module(entry.PROGRAMS[name][0]).main
    assert entry.main_of(name) is main
    with pytest.raises(SystemExit) as through:
        entry.main([name, "--help"])
    out = capsys.readouterr()
    assert through.value.code == 0 and out.err == "" and out.out.startswith("usage:"), out


@pytest.mark.slow  # an interpreter that imports torch: ~3 s
def test_a_program_s_errors_keep_their_form():
    proc = distlab("train", "--set", "max_steps=1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["python -m distlab train: error: the following arguments are required: "
                                        "--config (see python -m distlab train --help)"]
