"""boltzlabs: thousands of sandboxed RL environments behind one batched step.

    from boltzlabs import RLPool            # the client (imports numpy)
    from boltzlabs.env import serve         # inside an env (stdlib + msgpack only)
    from boltzlabs.gym import BoltzLabsVecEnv   # the Gymnasium adapter (boltzlabs[gym])
    from boltzlabs.sb3 import BoltzLabsSB3VecEnv   # the Stable-Baselines3 adapter (boltzlabs[sb3])
    from boltzlabs.testing import assert_reproducible   # for your env's CI (pytest)

Names are imported lazily: an env that does `from boltzlabs.env import serve`
must not pay for numpy or the client, since every env of a pool pays for
what it imports.
"""

__version__ = "0.1.0"

_LAZY = {
    "RLPool": "boltzlabs.pool.client",
    "Timing": "boltzlabs.pool.client",
    "MemoryReport": "boltzlabs.pool.client",
    "EnvContract": "boltzlabs.pool.client",
    "BoltzLabsVecEnv": "boltzlabs.gym",  # needs gymnasium (boltzlabs[gym])
    "BoltzLabsSB3VecEnv": "boltzlabs.sb3",  # needs stable-baselines3 (boltzlabs[sb3])
    "assert_reproducible": "boltzlabs.testing",
    "NotReproducible": "boltzlabs.testing",
    "EnvError": "boltzlabs.errors",
    "BoltzLabsError": "boltzlabs.errors",
    "EnvStartError": "boltzlabs.errors",
    "PoolClosedError": "boltzlabs.errors",
    "WorkerError": "boltzlabs.errors",
    "SandboxUnavailable": "boltzlabs.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'boltzlabs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
