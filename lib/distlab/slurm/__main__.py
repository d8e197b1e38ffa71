from distlab.cli import run_main
from distlab.slurm.cli import main

run_main(main)
