"""`python -m distlab.scaling`: step logs of several run folders -> the scaling table and plots.

The command lives in distlab.commands.scaling; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.scaling import main

if __name__ == "__main__":
    run_main(main)
