"""`python -m distlab.monitor`: device utilisation (GPU, or CPU % and RSS per process) around any command.

The command lives in distlab.commands.monitor; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.monitor", run_name="__main__")
