"""ALE/Pong-v5 as agents usually see it: AtariPreprocessing (frame skip 4, 84 x 84
grey, no-op starts) and the last 4 frames stacked, obs (4, 84, 84) uint8, for
benchmarks/bench_envs.py. ale-py ships its ROMs; opencv does the resizing.
`make()` is the same env for every implementation the benchmark compares."""

import gymnasium
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation


def make():
    """Pong behind AtariPreprocessing and a 4-frame stack (the base env skips no frames itself)."""
    return FrameStackObservation(AtariPreprocessing(gymnasium.make("ale_py:ALE/Pong-v5", frameskip=1)), 4)


if __name__ == "__main__":  # in a sandbox: env.py is run as __main__
    from boltzlabs.env import serve

    env = make()
    serve(
        reset=lambda seed, options=None: env.reset(seed=seed, options=options),
        step=env.step,
        observation_space=env.observation_space,
        action_space=env.action_space,
        target=env,
    )
