"""`python -m boltzlabs.worker --fd N`: the worker process (boltzlabs/worker/server.py)."""

import sys

from boltzlabs.worker.server import main

sys.exit(main())
