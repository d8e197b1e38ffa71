import sys

from distlab.slurm.cli import main

sys.exit(main())
