"""Host code on a training node: the remote listener (`boltzlabs worker --listen`) that serves pools to other hosts.

listener.py authenticates clients and hands each connection to its own
worker process; envcache.py keeps shipped env directories. It runs beside
the workers it starts, never in the trainer: it may import errors, units,
abi, wire, link (the handshake both ends of the remote link share),
runtime/, sandbox/ and worker/, and never pool/ (the trainer's side);
tests/test_layout.py checks it.
"""
