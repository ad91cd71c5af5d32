"""Code that runs inside a sandbox: the env's serve loop, the template, confinement, rlimits, seccomp loading.

Every env pays for what this package imports, so it imports only the
standard library, msgpack, boltzlabs.wire, boltzlabs.errors and
boltzlabs.runtime.* (gym_env/env.py, env code itself, may import gymnasium).
Nothing here imports numpy or any host-side package (tests/test_layout.py).
"""
