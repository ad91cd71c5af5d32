#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for boltzlabs: bubblewrap and libseccomp from apt,
# a virtualenv in .venv with boltzlabs and its test extras. Idempotent.
#   bash ci/setup.sh            boltzlabs and the test extras (what ci/test.sh runs)
#   bash ci/setup.sh --minimal  boltzlabs alone: what a pool needs (what ci/demo.sh runs)
set -euo pipefail
cd "$(dirname "$0")/.."
minimal=0
if [ "${1:-}" = --minimal ]; then minimal=1; fi

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
if [ "$minimal" = 1 ]; then
  echo "ci/setup.sh: installing boltzlabs and what a pool needs (msgpack, numpy, psutil, tqdm, pyseccomp) into .venv"
  .venv/bin/python -m pip install -q -e .
else
  # Stable-Baselines3 (a test extra) needs torch, and PyPI's torch for Linux is the CUDA build:
  # ~3 GB of wheels, ~5.4 GB installed. A CPU build pip can see (a "+cpu" wheel in one of
  # its find-links directories) is installed first where there is one; or name one in
  # BOLTZLABS_TORCH (a wheel, or a requirement such as "torch==2.13.0+cpu").
  torch=${BOLTZLABS_TORCH:-$(.venv/bin/python ci/cpu_torch.py)}
  if [ -n "$torch" ]; then
    echo "ci/setup.sh: installing torch's CPU build first ($torch)"
    .venv/bin/python -m pip install -q "$torch"
  elif ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "ci/setup.sh: no CPU build of torch at hand: Stable-Baselines3 pulls PyPI's CUDA build (~3 GB of wheels," \
         "+5.4 GB installed; BOLTZLABS_TORCH=<wheel or requirement> names another)"
  fi
  echo "ci/setup.sh: installing boltzlabs and the test extras (pytest, hypothesis, gymnasium with ale-py, minigrid," \
       "box2d and mujoco, matplotlib, ray, stable-baselines3, ruff and mypy) into .venv"
  .venv/bin/python -m pip install -q -e ".[test]"
fi
# The editable install finds boltzlabs through a finder consulted after every directory of
# sys.path; run from the folder that holds this checkout, that folder's "boltzlabs" (the
# checkout, no __init__.py) is taken first, for an empty namespace package, and
# `from boltzlabs import RLPool` fails. A .pth naming the checkout puts the real package on
# sys.path, where it wins over any namespace directory.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD" > "$site/boltzlabs-checkout.pth"
path=$(.venv/bin/python -c "from boltzlabs.worker import native; print('native' if native.load()[0] else 'pure Python (the extension did not build: see pip output above)')")
echo "boltzlabs is set up in .venv ($(.venv/bin/python --version), $(bwrap --version), step path: $path)"
