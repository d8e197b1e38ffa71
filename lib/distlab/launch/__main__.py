from distlab.cli import run_main
from distlab.launch.seeds import main

run_main(main)
