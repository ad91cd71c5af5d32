#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the whole test suite on the native step path
# (boltzlabs.worker._fastpath), the step-path tests again on the pure-Python one (BOLTZLABS_PURE=1),
# then the fuzz and fault tests under AddressSanitizer (ci/asan.sh). Exit
# status: the first failure's; "no tests ran" (pytest's 5) counts as a failure.
# Arguments go to every pytest run. CI_PATHS="native" (or "pure") runs one path;
# CI_ASAN=0 skips the sanitizer run. Each stage prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh

status=0
run() {  # run <label> <command...>: time it, keep the first failure
  local label=$1 started rc
  shift
  started=$(date +%s)
  set +e
  "$@"
  rc=$?
  set -e
  if [ "$rc" = 5 ]; then
    echo "pytest collected no tests ($label): that is a failure" >&2
    rc=1
  fi
  echo "ci/test.sh: $label: exit $rc in $(( $(date +%s) - started )) s" >&2
  if [ "$status" = 0 ]; then status=$rc; fi
}

for path in ${CI_PATHS:-native pure}; do
  case $path in
    native)
      if ! .venv/bin/python -c "import boltzlabs.worker._fastpath" 2>/dev/null; then
        echo "ci/test.sh: boltzlabs.worker._fastpath is not built: the native run cannot run" >&2
        status=1
        continue
      fi
      run "suite, native path" env -u BOLTZLABS_PURE .venv/bin/python -m pytest -q -p no:cacheprovider "$@" ;;
    pure)
      # Every test file whose pools step through the worker (the only code the two
      # paths do not share); the rest (sandbox construction, seccomp, the CLI,
      # packaging, Gymnasium's ported suite, Ray) runs once, on the native path,
      # to keep the whole run near 15 minutes. CI_PURE_ALL=1 runs everything.
      if [ "${CI_PURE_ALL:-0}" = 1 ] || [ $# -gt 0 ]; then
        files=()
      else
        files=(tests/test_pool.py tests/test_faults.py tests/test_async.py tests/test_arrays.py
               tests/test_attacks.py tests/test_limits.py tests/test_memory_and_gate.py tests/test_native.py
               tests/test_wire.py tests/test_hostile_wire.py tests/test_template.py tests/test_gym.py
               tests/test_gym_compat.py tests/test_remote.py tests/test_testing.py)
      fi
      run "suite, pure-Python path" env BOLTZLABS_PURE=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
        "${files[@]}" "$@" ;;
    *)
      echo "ci/test.sh: unknown path $path in CI_PATHS (native, pure)" >&2
      exit 2 ;;
  esac
done
if [ "${CI_ASAN:-1}" != 0 ]; then
  run "ASan+UBSan over the fuzz and fault tests" bash ci/asan.sh
fi
exit "$status"
