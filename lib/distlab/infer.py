"""`python -m distlab.infer`: answers before and after a LoRA adapter, with key-fact accuracy.

The command lives in distlab.commands.infer; this module keeps the name the README documents."""

from distlab.cli import run_main
from distlab.commands.infer import main

if __name__ == "__main__":
    run_main(main)
