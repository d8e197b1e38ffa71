"""`python -m distlab.matrix`: the strategy x world-size matrix, run locally with generated torchrun scripts.

The command lives in distlab.commands.matrix; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.matrix import main

if __name__ == "__main__":
    run_main(main, sigterm_exits=True)
