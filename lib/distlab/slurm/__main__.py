from distlab.cli import run_main
from distlab.slurm.command import main

run_main(main)
