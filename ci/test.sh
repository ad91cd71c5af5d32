#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the whole test suite. Exit status is pytest's;
# "no tests ran" (pytest's 5) counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$status"
