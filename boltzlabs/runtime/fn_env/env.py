"""The env directory of every env_fns pool: `BoltzLabsVecEnv([make_env(i) for i in range(n)])`.

Shipped read-only with the runtime. Lane i imports the plugins that
registered the trainer's Gymnasium ids, unpickles the trainer's env_fns[i]
from the pool's env_fns file and calls it (boltzlabs/runtime/env_fns.py),
in its own finished sandbox, then serves the env it returned (serve_env). In
template mode this file runs in each forked env once it is a sandbox, like any
env.py; the template imports only the library modules its warm-up probe saw
it use (Gymnasium, cloudpickle's unpickling), and never calls a thunk.
"""

import cloudpickle  # noqa: F401 (what unpickling a thunk imports, once, where it can be shared)
import gymnasium  # noqa: F401

from boltzlabs.runtime.env_fns import build
from boltzlabs.runtime.gym_serve import serve_env
from boltzlabs.runtime.serve import params, serve_each

# "import": the plugins whose ids the trainer's Gymnasium registry holds (boltzlabs/pool/sources.py).
serve_each(lambda: serve_env(build(params().get("import", ()))))
