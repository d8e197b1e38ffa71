"""`python -m distlab.accept`: the enterprise demo's acceptance checks over run folders.

The command lives in distlab.commands.accept; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.accept", run_name="__main__")
