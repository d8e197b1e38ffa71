"""`python -m distlab <command> [ARG ...]` (or the `distlab` console script): the one entry point of the user's
commands, each a module of distlab.commands with a `main(argv)`, and of the programs behind the chapters (train,
launch, lan, slurm, inference, machine); `python -m distlab --help` lists them.

The command gets every argument after its name unchanged and runs under distlab.cli.run_main: bad input is one
line `python -m distlab <command>: error: ...` and exit 2, `--debug` (before any `--`) shows the traceback.
A command's module is imported only when it runs, so the listing stays fast and loads no torch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import textwrap
from typing import Callable, Sequence

from distlab.cli import USAGE_EXIT, prog_name, run_main

# name -> module (a `main(argv) -> int` and a docstring whose first line describes it), in the order a user
# meets them. A new module in distlab.commands goes here too (tests/unit/test_entry_point.py checks it).
COMMANDS = {
    "plan": "distlab.commands.plan",
    "matrix": "distlab.commands.matrix",
    "monitor": "distlab.commands.monitor",
    "scaling": "distlab.commands.scaling",
    "report": "distlab.commands.report",
    "infer": "distlab.commands.infer",
    "accept": "distlab.commands.accept",
}
# Commands that launch jobs: a SIGTERM (a timeout, a scheduler) exits through their runner, which kills the jobs'
# process groups instead of leaving them running.
LAUNCHES_JOBS = {"matrix", "monitor"}

# The programs behind the chapters, each also `python -m <its module>` (torchrun starts distlab.train per rank
# that way): name -> (the module with its main(argv), what it does). `python -m distlab train ...` runs the same.
PROGRAMS = {
    "train": ("distlab.train", "The one training loop under any strategy (--config FILE, --set KEY=VALUE)"),
    "launch": ("distlab.launch.catalog", "The launch/ scripts: write them from the catalog, or check they are current"),
    "lan": ("distlab.lan.__main__", "The emulated LAN of chapters 05 and 08: up, down, status, reap"),
    "slurm": ("distlab.slurm.command", "The one-machine Slurm cluster of chapter 06: up, down, status"),
    "inference": ("distlab.inference.run", "One rank of pipeline inference (torchrun or srun start it per stage)"),
    "machine": ("distlab.machine", "What this machine has, and the `auto` parameters each chapter derives from it"),
}
OTHER_PROGRAMS = ("distlab.train", "distlab.launch", "distlab.lan", "distlab.slurm", "distlab.inference",
                  "distlab.machine")  # each program's own `python -m`, in PROGRAMS' order
# Like their own `python -m`: a SIGTERM of the LAN's commands kills the process groups they started
PROGRAMS_LAUNCHING_JOBS = {"lan"}


def summary(name: str) -> str:
    """The first line of a command's module docstring, read from its source without importing it."""
    path = importlib.util.find_spec(COMMANDS[name]).origin
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
    return doc.split("\n", 1)[0].strip().rstrip(".")


def usage(prog: str) -> str:
    width = max(map(len, [*COMMANDS, *PROGRAMS]))
    rows = "\n".join(f"  {name:<{width}}  {summary(name)}" for name in COMMANDS)
    programs = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in PROGRAMS.items())
    others = textwrap.fill("Each program is also its own module: python -m " + ", ".join(OTHER_PROGRAMS) + ".",
                           width=100, subsequent_indent="  ")
    return (f"usage: {prog} COMMAND [ARG ...]   ({prog} COMMAND --help: the command's own options)\n\n"
            f"commands:\n{rows}\n\nprograms:\n{programs}\n\n"
            f"Bad input ends with one line and exit status 2; --debug (or DISTLAB_DEBUG=1) shows the traceback.\n"
            f"{others}")


def main_of(name: str) -> Callable[[list[str]], int | None]:
    module = COMMANDS[name] if name in COMMANDS else PROGRAMS[name][0]
    return importlib.import_module(module).main  # deferred: only the command that runs loads its imports


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name()
    end = argv.index("--") if "--" in argv else len(argv)
    at = next((i for i in range(end) if argv[i] != "--debug"), None)  # `--debug` may come before the command
    name = argv[at] if at is not None else None
    if name in ("-h", "--help"):
        print(usage(prog))
        return 0
    if name not in COMMANDS and name not in PROGRAMS:
        said = f"unknown command {name!r}" if name is not None else "no command given"
        print(f"{prog}: error: {said}; one of {', '.join([*COMMANDS, *PROGRAMS])} (see {prog} --help)",
              file=sys.stderr)
        return USAGE_EXIT
    run_main(main_of(name), argv[:at] + argv[at + 1:], prog=f"{prog} {name}",
             sigterm_exits=name in LAUNCHES_JOBS | PROGRAMS_LAUNCHING_JOBS)


if __name__ == "__main__":
    sys.exit(main())
