"""The sandbox, host side (in the worker): policy data read, compiled and turned into bwrap command lines.

policy.py reads sandbox/ and mounts/; builder.py makes the bwrap argv;
seccomp.py compiles the filter; limits.py resolves [env_limits]; identity.py
and cgroups.py own host accounts and cgroups. May import runtime/*, wire,
errors, units and host/*; never worker/, pool/ or an adapter.
"""
