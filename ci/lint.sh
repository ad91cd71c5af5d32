#!/usr/bin/env bash
# Lint and type checks, configured in pyproject.toml ([tool.ruff], [tool.mypy]):
#   ruff check           pyflakes, pycodestyle errors, import order, bugbear, pyupgrade
#   ruff format --check  the formatter's layout (reports; LINT_FORMAT=0 skips it)
#   mypy                 strict on the contracts (wire, abi, link, worker/lanes, runtime/, sandbox/)
# Each runs to the end and says what it found; the exit status is the first failure's.
# ruff and mypy come with the test extras (pip install -e ".[test]"); RUFF= and MYPY= name others.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
ruff=(${RUFF:-"$python" -m ruff})
mypy=(${MYPY:-"$python" -m mypy})
status=0
run() {  # run <label> <command...>
  local label=$1 rc
  shift
  echo "ci/lint.sh: $label: $*" >&2
  "$@"
  rc=$?
  echo "ci/lint.sh: $label: exit $rc" >&2
  if [ "$status" = 0 ]; then status=$rc; fi
}
run "ruff check" "${ruff[@]}" check .
if [ "${LINT_FORMAT:-1}" != 0 ]; then
  run "ruff format --check" "${ruff[@]}" format --check .
fi
run "mypy" "${mypy[@]}"
exit "$status"
