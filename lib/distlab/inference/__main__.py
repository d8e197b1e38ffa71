from distlab.cli import run_main
from distlab.inference.run import main

run_main(main)
