"""`serve_env(env)`: serve a Gymnasium env object, with its spaces, metadata, render_mode and render.

    env.py:  env = gymnasium.make(...)  (any gymnasium.Env, wrapped as you like)
             serve_env(env) --> serve(reset=env.reset, step=env.step, observation_space=...,
                                      action_space=..., metadata=..., render=env.render,
                                      render_mode=env.render_mode, target=env, methods=...)

Runs inside the sandbox, and imports nothing beyond serve()'s: the env has
imported Gymnasium already, and its wrappers are told apart by their classes'
names. Every Gymnasium source (runtime/gym_env) and every env_fns
pool (runtime/fn_env) serves its env through it.
"""

from __future__ import annotations

from boltzlabs.runtime.serve import WRAPPER_CLASSES, serve

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

__all__ = ["serve_env", "NP_RANDOM_SEED", "SPACES"]

# The method that answers an adapter's check that every lane has the same
# spaces (env_fns may build different envs): this env's [observation, action] specs.
SPACES = "boltzlabs_spaces"

# The method that answers the Gymnasium adapter's np_random_seed: the env's own
# np_random_seed, as SyncVectorEnv's get_attr reads it (an env with no generator
# yet makes one then, from a seed drawn from entropy). msgpack carries 64-bit
# ints and numpy draws 128-bit seeds: one that does not fit travels as its
# decimal digits (the adapter checks them: boltzlabs/gym.py).
NP_RANDOM_SEED = "boltzlabs_np_random_seed"


def _metadata(metadata: Any) -> dict[str, Any]:
    # Metadata may hold anything (a class, a function): keep what can travel.
    from boltzlabs import wire

    kept = {}
    for key, value in dict(metadata or {}).items():
        try:
            wire.encode(value)
        except (TypeError, ValueError, OverflowError):
            continue
        kept[str(key)] = value
    return kept


def _is_wrapper(obj: Any) -> bool:
    # isinstance(obj, gymnasium.Wrapper), by name: no import (the env has Gymnasium, this module need not).
    return any(cls.__module__ == "gymnasium.core" and cls.__qualname__ == "Wrapper" for cls in type(obj).__mro__)


def serve_env(
    env: Any, *, preload: Any = (), warmup_actions: Any = None, methods: Any = None, attributes: Any = None
) -> None:
    """Serve the Gymnasium env object `env` to the pool that started this sandbox. Never returns.

        env = gymnasium.make("CartPole-v1")
        serve_env(env)

    Its reset (called `reset(seed=..., options=...)`), step, observation and
    action spaces, metadata (what can cross the wire), render_mode and render
    go to serve(); `pool.call` / `get_attr` / `set_attr` reach the env through
    its wrappers (target=env: get_wrapper_attr / set_wrapper_attr, as
    SyncVectorEnv's do). `methods` and `attributes` add to what they reach;
    `preload` and `warmup_actions` are serve()'s.
    """

    def wrapper_classes() -> Any:
        """Every class (each wrapper's MRO, as `module.qualname`) of the wrappers
        around the env: what the SB3 adapter's env_is_wrapped() looks in, as an
        isinstance() over the wrapper chain would (no class object crosses the wire)."""
        names, layer = [], env
        while _is_wrapper(layer):
            names += [f"{cls.__module__}.{cls.__qualname__}" for cls in type(layer).__mro__]
            layer = layer.env
        return sorted(set(names))

    def np_random_seed() -> Any:
        seed = getattr(env, "np_random_seed", None)  # through the wrappers, drawn if there is none yet
        if seed is None:
            return -1
        seed = seed.__index__()  # an int or a numpy integer; anything else fails the call
        return seed if -1 <= seed < 1 << 63 else str(seed)

    def spaces() -> Any:
        from boltzlabs.runtime.spec import to_spec

        return [to_spec(env.observation_space), to_spec(env.action_space)]

    serve(
        reset=env.reset,
        step=env.step,
        observation_space=env.observation_space,
        action_space=env.action_space,
        metadata=_metadata(getattr(env, "metadata", None)),
        render=env.render,
        render_mode=getattr(env, "render_mode", None),
        target=env,
        preload=preload,
        warmup_actions=warmup_actions,
        methods={
            WRAPPER_CLASSES: wrapper_classes,
            NP_RANDOM_SEED: np_random_seed,
            SPACES: spaces,
            **dict(methods or {}),
        },
        attributes=attributes,
    )
