"""`python -m distlab.report`: result markers in logs -> metrics csv, plots and BENCHMARK_REPORT.md.

The command lives in distlab.commands.report; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.report", run_name="__main__")
