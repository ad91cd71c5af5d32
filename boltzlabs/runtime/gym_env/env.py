"""The env directory of every Gymnasium source: `RLPool("gym://CartPole-v1", n)`.

Shipped read-only with the runtime. The client resolved the id and checked
the params (boltzlabs/pool/sources.py); they arrive here as
{"id": ..., "kwargs": {...}, "import": module or None} through
boltzlabs.env.params(). "import" names the module that registered the id in
the trainer (a plugin's: ale_py for "ALE/Pong-v5"), imported here first so
that this process's registry knows the id too.
"""

import importlib

import gymnasium

from boltzlabs.runtime.gym_serve import serve_env
from boltzlabs.runtime.serve import params

spec = params()
if spec.get("import"):
    importlib.import_module(spec["import"])
serve_env(gymnasium.make(spec["id"], **spec["kwargs"]))
