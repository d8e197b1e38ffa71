from distlab.cli import run_main
from distlab.launch.kubernetes.cli import main

run_main(main)
