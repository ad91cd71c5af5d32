"""`python -m boltzlabs`: the boltzlabs command (boltzlabs.cli)."""

import sys

from boltzlabs.cli import main

sys.exit(main())
