"""`python -m distlab.monitor`: device utilisation (GPU, or CPU % and RSS per process) around any command.

The command lives in distlab.commands.monitor; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.monitor import main

if __name__ == "__main__":
    run_main(main, sigterm_exits=True)
