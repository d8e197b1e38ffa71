import sys

from distlab.inference.run import main

sys.exit(main())
