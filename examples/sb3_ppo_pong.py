"""Stable-Baselines3's PPO with CnnPolicy on Pong: 84x84 grey frames, 4 stacked, each env in its own sandbox.

    python examples/sb3_ppo_pong.py                                    # rl-baselines3-zoo's Atari PPO, 10M steps
    python examples/sb3_ppo_pong.py --timesteps 256 --n-envs 2 --n-steps 64   # a short run

Each env is built by its own thunk, as SB3's scripts build them for
SubprocVecEnv: ALE/Pong-v5 without frame skipping or sticky actions,
Gymnasium's AtariPreprocessing (noop starts, frame skip 4, 84x84 grey
frames) and FrameStackObservation (4 frames: observations are uint8 (4, 84,
84), channels first, which CnnPolicy takes as they are). The thunks are
pickled here and called inside the sandboxes; SubprocVecEnv's place is taken
by BoltzLabsSB3VecEnv, and nothing else changes. The hyperparameters are
rl-baselines3-zoo's for Atari PPO. Pong learns over millions of steps: hours
on a GPU, days on two CPU cores; the short run shows the loop working.
Needs ale-py and stable-baselines3 (`pip install -e '.[test]'` has both).
"""

from __future__ import annotations

import argparse

import ale_py
import gymnasium as gym
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import VecMonitor

from boltzlabs.sb3 import BoltzLabsSB3VecEnv

gym.register_envs(ale_py)


def make_env(rank: int, seed: int):
    def thunk():
        env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
        env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
        env = FrameStackObservation(env, 4)
        env.action_space.seed(seed + rank)
        return env

    return thunk


def main(argv=None) -> PPO:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timesteps", type=int, default=10_000_000)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--n-steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="where to save the trained model (a .zip)")
    args = parser.parse_args(argv)

    venv = VecMonitor(BoltzLabsSB3VecEnv([make_env(i, args.seed) for i in range(args.n_envs)]))
    venv.seed(args.seed)
    model = PPO(
        "CnnPolicy",
        venv,
        n_steps=args.n_steps,
        n_epochs=4,
        batch_size=min(256, args.n_steps * args.n_envs),
        learning_rate=lambda progress: 2.5e-4 * progress,
        clip_range=lambda progress: 0.1 * progress,
        ent_coef=0.01,
        vf_coef=0.5,
        seed=args.seed,
        verbose=1,
    )
    try:
        model.learn(total_timesteps=args.timesteps)
        if args.save:
            model.save(args.save)
    finally:
        venv.close()
    return model


if __name__ == "__main__":
    main()
