"""`python -m distlab.scaling`: step logs of several run folders -> the scaling table and plots.

The command lives in distlab.commands.scaling; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.scaling", run_name="__main__")
