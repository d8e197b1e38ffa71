"""`python -m distlab.infer`: answers before and after a LoRA adapter, with key-fact accuracy.

The command lives in distlab.commands.infer; this module keeps the name the README documents."""

import runpy

if __name__ == "__main__":
    runpy.run_module("distlab.commands.infer", run_name="__main__")
