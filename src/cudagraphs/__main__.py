"""`python -m cudagraphs`: the command line (doctor, bench, profile, demo)."""

import sys

from .tools import main

sys.exit(main())
