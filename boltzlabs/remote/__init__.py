"""An adapter: the remote listener (`boltzlabs worker --listen`) that serves pools to other hosts.

listener.py authenticates clients and hands each connection to its own
worker process; envcache.py keeps shipped env directories. As an adapter it
may import anything below (pool/, worker/, sandbox/, runtime/); nothing
below imports it.
"""
