#!/usr/bin/env bash
# The native code (native/fastpath.c, native/wire.c) under AddressSanitizer and UBSan:
# build boltzlabs.worker._fastpath and boltzlabs._wire with -fsanitize=address,undefined into a copy of
# the tree in a temp dir, and run the fuzz and fault tests there with libasan
# preloaded (CPython itself is not instrumented, so the preload must come
# first). Leak detection is off: CPython keeps memory until exit by design.
# Any sanitizer report fails the run (halt_on_error, and UBSan's
# -fno-sanitize-recover makes a report fatal). Called by ci/test.sh;
# extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # absolute, symlink kept: it is the venv
[ -x "$PY" ] || { echo "ci/asan.sh: $PY is missing; run bash ci/setup.sh first" >&2; exit 1; }
libasan=$(gcc -print-file-name=libasan.so)
[ -e "$libasan" ] || { echo "ci/asan.sh: gcc has no libasan.so; install gcc (bash ci/setup.sh)" >&2; exit 1; }
libasan=$(readlink -f "$libasan")

tmp=$(mktemp -d /tmp/boltzlabs-asan.XXXXXX)
# A report is written to a file (pytest captures fd 2 and would lose it when
# the process aborts) and shown on the way out.
trap 'cat "$tmp"/sanitizer.log.* >&2 2>/dev/null || true; rm -rf "$tmp"' EXIT
# The tree the tests import: the worker they start imports boltzlabs from the
# same root (client._worker_environment), so it runs the instrumented build too.
cp -r boltzlabs native sandbox mounts examples tests setup.py pyproject.toml "$tmp"/
rm -f "$tmp"/boltzlabs/worker/_fastpath*.so "$tmp"/boltzlabs/_wire*.so
# gcc directly (not setup.py: that needs the build backend's setuptools in this venv).
read -r include suffix < <("$PY" -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
  -Wall -Werror -I"$include" native/fastpath.c -o "$tmp/boltzlabs/worker/_fastpath$suffix"
# The wire's codec is imported by envs too, whose sandboxes get no LD_PRELOAD, and an
# instrumented library loaded without the ASan runtime first aborts its process: so the
# instrumented _wire is kept out of the package's directory (which sandboxes mount) and
# found by the sitecustomize below, which only this interpreter and the worker run.
# The sandboxes' envs use wire.py's Python codec in this run.
mkdir "$tmp/asan"
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
  -Wall -Werror -I"$include" native/wire.c -o "$tmp/asan/_wire$suffix"

# .venv's editable install of boltzlabs is a meta path finder, which wins
# over PYTHONPATH: a sitecustomize in the copy takes it out, so this
# interpreter, and the worker the tests start (its PYTHONPATH names the same
# root: client._worker_environment), import the copy and its instrumented build.
cat > "$tmp/sitecustomize.py" <<PY
import importlib.util
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                    and "__editable__" not in getattr(type(f), "__module__", "")]


class _InstrumentedWire:
    def find_spec(self, name, path=None, target=None):
        if name == "boltzlabs._wire":
            return importlib.util.spec_from_file_location(name, "$tmp/asan/_wire$suffix")
        return None


sys.meta_path.insert(0, _InstrumentedWire())
PY

export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$tmp/sanitizer.log"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$tmp/sanitizer.log"
cd "$tmp"
PYTHONPATH="$tmp" LD_PRELOAD="$libasan" "$PY" -c \
  "import boltzlabs.worker._fastpath as f, boltzlabs._wire as w, sys; sys.exit(not (f.__file__.startswith('$tmp') and w.__file__.startswith('$tmp')))" \
  || { echo "ci/asan.sh: the instrumented boltzlabs.worker._fastpath or boltzlabs._wire is not the one imported" >&2; exit 1; }
# Only the pytest process and its worker get the preload: bwrap is spawned
# with an empty environment (spawn._posix_spawn), so no sandbox does.
# The pure-path halves of the parametrized tests (ids [pure...]) run no C, but
# a test whose name says "pure" may compare C with it: "[pure", not "pure".
# The flood test measures the worker's peak RSS, which ASan's shadow memory
# and quarantine inflate (it passes on both paths in the normal build); the
# missing-extension test runs no C, and its sitecustomize would shadow the
# one above. keep_heap's test counts glibc's page faults, and ASan replaces
# malloc (mallopt does nothing there: keep_heap() says False).
# test_native.py drives step() over real fds; test_wire.py's frame
# fuzz tests run through step() too (tests/framers.py's native reader).
PYTHONPATH="$tmp" LD_PRELOAD="$libasan" "$PY" -m pytest -q -p no:cacheprovider \
  -k "not [pure and not costs_the_worker_little and not warn_once and not keep_heap" \
  tests/test_native.py tests/test_native_step.py tests/test_wire.py tests/test_codec.py tests/test_faults.py \
  tests/test_hostile_wire.py "$@"
