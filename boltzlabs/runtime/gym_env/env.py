"""The env directory of every Gymnasium source: `RLPool("gym://CartPole-v1", n)`.

Shipped read-only with the runtime. The client resolved the id and checked
the params (boltzlabs/pool/sources.py); they arrive here as
{"id": ..., "kwargs": {...}} through boltzlabs.env.params().
"""

import gymnasium

from boltzlabs.runtime.serve import WRAPPER_CLASSES, params, serve

spec = params()
env = gymnasium.make(spec["id"], **spec["kwargs"])


def reset(seed, options=None):
    return env.reset(seed=seed, options=options)


def _metadata(metadata):
    # Metadata may hold anything (a class, a function): keep what can travel.
    from boltzlabs import wire

    kept = {}
    for key, value in dict(metadata).items():
        try:
            wire.encode(value)
        except (TypeError, ValueError, OverflowError):
            continue
        kept[str(key)] = value
    return kept


def wrapper_classes():
    """Every class (each wrapper's MRO, as `module.qualname`) of the wrappers
    around the env: what the SB3 adapter's env_is_wrapped() looks in, as an
    isinstance() over the wrapper chain would (no class object crosses the wire)."""
    names, layer = [], env
    while isinstance(layer, gymnasium.Wrapper):
        names += [f"{cls.__module__}.{cls.__qualname__}" for cls in type(layer).__mro__]
        layer = layer.env
    return sorted(set(names))


# target=env: pool.call / get_attr / set_attr reach the Gymnasium env itself,
# through its wrappers (get_wrapper_attr / set_wrapper_attr), as SyncVectorEnv's do.
serve(reset=reset, step=env.step, observation_space=env.observation_space, action_space=env.action_space,
      metadata=_metadata(env.metadata), render=env.render, render_mode=env.render_mode, target=env,
      methods={WRAPPER_CLASSES: wrapper_classes})
