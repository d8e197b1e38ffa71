"""`python -m distlab.report`: result markers in logs -> metrics csv, plots and BENCHMARK_REPORT.md.

The command lives in distlab.commands.report; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.report import main

if __name__ == "__main__":
    run_main(main)
