import sys

from distlab.launch.seeds import main

sys.exit(main())
