#!/usr/bin/env bash
# Set up (ci/setup.sh), then run at the same time, each in its own pytest session:
#   native  the whole test suite on the native step path (boltzlabs.worker._fastpath);
#   pure    the whole test suite again on the pure-Python one (BOLTZLABS_PURE=1), less the
#           files that never start a pool (PURE_SKIPS below): every test that runs a pool runs on both;
#   asan    the fuzz and fault tests under AddressSanitizer and UBSan (ci/asan.sh);
#   v2      the cgroup tests in a cgroup-v2-only QEMU guest, twice, then once more in one booted
#           with systemd as PID 1 (ci/v2guest.sh, ci/v2tests.sh);
#   lint    ruff check, ruff format --check and mypy (ci/lint.sh), when no arguments choose tests.
# Much of the suite waits (sandboxes starting, envs sleeping, time-outs running out, Ray
# starting), so two sessions at once on two cores take far less than the two in turn
# (docs/ci.md has the figures). While they run, a progress line every CI_PROGRESS seconds
# (30) says how far each stage is and how many tests failed so far; each stage's
# output is printed whole when it ends, with how long it took. Exit status: the first
# failed stage's; "no tests ran" (pytest's 5) counts as a failure.
# Arguments go to every pytest run. CI_PATHS="native" (or "pure") runs one path;
# CI_ASAN=0 skips the sanitizer run; CI_LINT=0 the lint stage; CI_SERIAL=1 runs the stages one
# after another. One test file on one path, no ASan:
#   CI_PATHS=native CI_ASAN=0 bash ci/test.sh tests/test_wire.py
set -euo pipefail
cd "$(dirname "$0")/.."
echo "ci/test.sh: setting up (ci/setup.sh: apt packages if missing, .venv with the test extras)" >&2
bash ci/setup.sh

# Files whose tests never start a pool, so never reach the step path: the lane state
# machine, the module layout, the wire format (whose tests run both framers,
# native and pure, in-process whichever path the session's pools take), and the
# wake benchmark's checks (a C program, no boltzlabs).
PURE_SKIPS=(tests/test_lanes.py tests/test_layout.py tests/test_wire.py tests/test_benchmarks.py)

logs=$(mktemp -d /tmp/boltzlabs-ci.XXXXXX)
trap 'rm -rf "$logs"' EXIT
declare -A label_of started_at
pending=()
status=0

start() {  # start <name> <label> <command...>: run it in the background, output to $logs/<name>
  local name=$1 label=$2
  shift 2
  label_of[$name]=$label
  started_at[$name]=$(date +%s)
  pending+=("$name")
  echo "ci/test.sh: started $label" >&2
  ( set +e; "$@" >"$logs/$name" 2>&1; echo $? >"$logs/$name.rc" ) &
  if [ "${CI_SERIAL:-0}" = 1 ]; then wait "$!"; fi
}

finish() {  # finish <name>: print its output and time, keep the first failure
  local name=$1 rc
  rc=$(cat "$logs/$name.rc")
  echo "===== ${label_of[$name]} ====="
  cat "$logs/$name"
  if [ "$rc" = 5 ]; then
    echo "pytest collected no tests (${label_of[$name]}): that is a failure" >&2
    rc=1
  fi
  echo "ci/test.sh: ${label_of[$name]}: exit $rc in $(( $(date +%s) - ${started_at[$name]} )) s" >&2
  if [ "$status" = 0 ]; then status=$rc; fi
}

# CI runs where sandboxes can be built: a test that would skip for want of one fails instead.
export BOLTZLABS_REQUIRE_SANDBOX=${BOLTZLABS_REQUIRE_SANDBOX:-1}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
for path in ${CI_PATHS:-native pure}; do
  case $path in
    native)
      if ! .venv/bin/python -c "import boltzlabs.worker._fastpath" 2>/dev/null; then
        echo "ci/test.sh: boltzlabs.worker._fastpath is not built: the native run cannot run" >&2
        status=1
        continue
      fi
      start native "suite, native path" env -u BOLTZLABS_PURE "${pytest[@]}" "$@" ;;
    pure)
      skips=()
      if [ $# = 0 ]; then
        for file in "${PURE_SKIPS[@]}"; do skips+=(--ignore="$file"); done
      fi
      start pure "suite, pure-Python path" env BOLTZLABS_PURE=1 "${pytest[@]}" "${skips[@]}" "$@" ;;
    *)
      echo "ci/test.sh: unknown path $path in CI_PATHS (native, pure)" >&2
      exit 2 ;;
  esac
done
if [ "${CI_ASAN:-1}" != 0 ]; then
  start asan "ASan+UBSan over the fuzz and fault tests" bash ci/asan.sh
fi
# Lint and types: seconds of CPU, so it runs beside the suites (skipped when arguments choose tests).
if [ "${CI_LINT:-1}" != 0 ] && [ $# = 0 ]; then
  start lint "ruff and mypy (ci/lint.sh)" bash ci/lint.sh
fi
# The cgroup tests on cgroup v2, in a guest with v1 disabled: worker in the root cgroup,
# then in a service's cgroup beside another process; then a second boot with systemd as
# PID 1, trainers in scopes systemd did not delegate and in a user's session (ci/v2tests.sh:
# its own choice of tests, so it runs only when no arguments choose others); CI_V2=0 skips
# it. Niced: the emulated guest would take both cores from the host stages' timed tests,
# while its own deadlines are scaled for a slow machine.
if [ "${CI_V2:-1}" != 0 ] && [ $# = 0 ]; then
  start v2 "cgroup tests in cgroup-v2-only guests (bash, then systemd, as PID 1)" nice -n 10 bash -c '
    bash ci/v2guest.sh bash ci/v2tests.sh; first=$?
    V2GUEST_INIT=systemd bash ci/v2guest.sh bash ci/v2tests.sh systemd; second=$?
    exit $(( first != 0 ? first : second ))'
fi

progress() {  # one line: how far each running stage is (pytest -q's "[ NN%]"), tests run, how many failed
  local line="ci/test.sh: $(( $(date +%s) - begun )) s:" name done marks tests failed
  for name in "${pending[@]}"; do
    done=$(grep -o '\[ *[0-9]*%\]' "$logs/$name" 2>/dev/null | tail -n 1 | tr -d '[] ' || true)
    # pytest -q's progress lines: one character per test (and the last line, not yet ended).
    marks=$(grep -E '^[.sxXFE]+ *(\[ *[0-9]+%\])?$' "$logs/$name" 2>/dev/null || true)
    tests=$(printf '%s' "$marks" | tr -cd '.sxXFE' | wc -c)
    failed=$(printf '%s' "$marks" | tr -cd 'FE' | wc -c)
    line+=" ${label_of[$name]} ${done:-0%} ($tests tests"
    if [ "$failed" != 0 ]; then line+=", $failed failed so far"; fi
    line+=");"
  done
  echo "${line%;}" >&2
}

# Whichever stage ends first is shown first; a progress line every CI_PROGRESS seconds.
begun=$(date +%s)
next_progress=$(( begun + ${CI_PROGRESS:-30} ))
while [ ${#pending[@]} -gt 0 ]; do
  left=()
  for name in "${pending[@]}"; do
    if [ -e "$logs/$name.rc" ]; then finish "$name"; else left+=("$name"); fi
  done
  pending=("${left[@]}")
  if [ ${#pending[@]} -gt 0 ] && [ "$(date +%s)" -ge "$next_progress" ]; then
    progress
    next_progress=$(( $(date +%s) + ${CI_PROGRESS:-30} ))
  fi
  [ ${#pending[@]} = 0 ] || sleep 1
done
exit "$status"
