#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for boltzlabs: bubblewrap and libseccomp from apt,
# a virtualenv in .venv with boltzlabs and its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v unshare >/dev/null || need+=(util-linux)
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || need+=(python3)
"$PYTHON" -c "import venv, ensurepip" 2>/dev/null || need+=(python3-venv)
# The seccomp filter is compiled with libseccomp (through pyseccomp, which finds it this way).
"$PYTHON" -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('seccomp'))" 2>/dev/null \
  || need+=(libseccomp2)
# The native step path (boltzlabs.worker._fastpath, native/fastpath.c) is built by pip
# with a C compiler and the headers of the Python the venv is made from
# (python3-dev for the system's; a pyenv or python.org build ships its own).
command -v gcc >/dev/null || need+=(gcc)
"$PYTHON" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" 2>/dev/null \
  || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} with apt-get"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".[test]"
path=$(.venv/bin/python -c "from boltzlabs.worker import native; print('native' if native.load()[0] else 'pure Python (the extension did not build: see pip output above)')")
echo "boltzlabs is set up in .venv ($(.venv/bin/python --version), $(bwrap --version), step path: $path)"
