"""`python -m distlab.matrix`: the strategy x world-size matrix, run locally with generated torchrun scripts.

The command lives in distlab.commands.matrix; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.matrix", run_name="__main__")
