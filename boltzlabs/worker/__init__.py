"""The worker process (host): owns the sandboxes of one pool, spawns them and drives them.

`python -m boltzlabs.worker --fd N`. The flow through its modules:

    server.py     entry point (main), the OPEN and CALL loop, teardown; Worker composes the parts below
    config.py     the OPEN request parsed and checked against the policy
    reactor.py    Reactor: the epoll loop, fds and callbacks, the client; Budget: the bytes held
    lanes.py      a lane and its one state machine (State, TRANSITIONS, Lane.to)
    lifecycle.py  Lifecycle: spawning, reading, killing and reaping lanes; the freezer
    requests.py   Requests: step (the hot path), reset, render, and the reads
    stepping.py   Stepping: send/recv and the serialize_measurement gate
    spawn.py      the Spawner protocol, exec and template spawners, SpawnContext
    ceilings.py   a remote client's limits

May import host/*, runtime/*, wire, errors, units and worker/*; never
pool/ or an adapter: the trainer starts it as a process by module name.
"""
