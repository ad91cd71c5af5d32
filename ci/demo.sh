#!/usr/bin/env bash
# Set up what a pool needs (ci/setup.sh --minimal: no test extras, no torch) and run the
# main job: a pool of the example env at scale (1000 envs by default), printing timing
# and envs_per_gb().
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh --minimal
exec .venv/bin/python examples/run_pool.py "$@"
