#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the main job: a pool of the example env at
# scale (1000 envs by default), printing timing and envs_per_gb().
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
exec .venv/bin/python examples/run_pool.py "$@"
