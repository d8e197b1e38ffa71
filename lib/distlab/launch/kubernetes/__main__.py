from distlab.cli import run_main
from distlab.launch.kubernetes.command import main

run_main(main)
