"""The trainer's side: RLPool and what it needs to reach a worker, local or remote.

protocol.py (Pool: the one protocol of every pool kind, its argument checks and
episode bookkeeping; ClusterPool in boltzlabs/cluster.py is its other kind),
client.py (RLPool), shards.py (one pool over several workers: RLPool(workers=k)),
sources.py (what a source names), imports.py (which modules an env may import),
slots.py (observations read from the worker's shared memory), ids.py (UUIDv7),
spaces.py (specs back to Gymnasium spaces), remote_link.py (the TCP client).
May import wire, errors, units and pool/*; never host/builder,
host/cgroups or worker internals (the worker is a process, started by name).
"""
