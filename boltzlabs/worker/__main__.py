"""`python -m boltzlabs.worker --fd N`: the worker process (boltzlabs/worker/worker.py)."""

import sys

from boltzlabs.worker.worker import main

sys.exit(main())
