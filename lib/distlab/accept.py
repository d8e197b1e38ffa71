"""`python -m distlab.accept`: the enterprise demo's acceptance checks over run folders.

The command lives in distlab.commands.accept; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.accept import main

if __name__ == "__main__":
    run_main(main)
