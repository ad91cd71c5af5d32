"""`from boltzlabs.env import serve`: the env author's entry point (boltzlabs/runtime/serve.py).

`serve(reset=, step=, ...)` serves functions; `serve_env(env)` serves a
Gymnasium env object, with its spaces, metadata, render_mode and render
(boltzlabs/runtime/gym_serve.py); `params()` reads the pool's params.
"""

from boltzlabs.runtime.gym_serve import serve_env
from boltzlabs.runtime.serve import params, serve

__all__ = ["serve", "serve_env", "params"]
