"""`python -m kvoffload.cli ...` is the `kvoffload` command."""

import sys

from .main import main

sys.exit(main())
