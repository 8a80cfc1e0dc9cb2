"""`python -m specextend.cli`: the `specextend` command."""

import sys

from .main import main

sys.exit(main())
