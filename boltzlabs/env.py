"""`from boltzlabs.env import serve`: the env author's entry point (boltzlabs/runtime/serve.py)."""
from boltzlabs.runtime.serve import params, serve

__all__ = ["serve", "params"]
