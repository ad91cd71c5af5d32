"""The worker process (host): owns the sandboxes of one pool, spawns them and drives them.

`python -m boltzlabs.worker --fd N` (worker.py: the reactor and requests,
spawn.py: exec and template spawners, ceilings.py: a remote client's limits).
May import sandbox/*, runtime/*, wire, errors, units and worker/*; never
pool/ or an adapter: the trainer starts it as a process by module name.
"""
