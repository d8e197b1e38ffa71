from distlab.cli import run_main
from distlab.launch.catalog import main

run_main(main)
