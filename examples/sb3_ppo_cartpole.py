"""Stable-Baselines3's PPO on CartPole, each env in its own sandbox, through BoltzLabsSB3VecEnv.

    pip install 'boltzlabs[sb3]' matplotlib      # from a checkout: PYTHONPATH=. python examples/...
    python examples/sb3_ppo_cartpole.py --out curve.csv                  # 50k steps, 8 sandboxed envs
    python examples/sb3_ppo_cartpole.py --timesteps 512 --n-envs 2 --n-steps 128 --out /tmp/c.csv

SB3's own PPO with rl-baselines3-zoo's tuned CartPole hyperparameters, on
`VecMonitor(BoltzLabsSB3VecEnv("CartPole-v1", n_envs))`: nothing in the
training code knows about sandboxes. After every rollout it appends a row to
the learning curve, `--out` (CSV: timesteps, episodes finished, the mean
return of the last 100 episodes, seconds), and draws it beside the CSV as a
PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecMonitor

from boltzlabs.sb3 import BoltzLabsSB3VecEnv


class LearningCurve(BaseCallback):
    """Appends (timesteps, episodes, mean return of the last 100, seconds) after each rollout."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.rows: list = []
        self.episodes = 0
        self.started = time.perf_counter()

    def _on_step(self) -> bool:
        self.episodes += sum("episode" in info for info in self.locals["infos"])
        return True

    def _on_rollout_end(self) -> None:
        returns = [episode["r"] for episode in self.model.ep_info_buffer]
        mean = sum(returns) / len(returns) if returns else math.nan
        self.rows.append((self.num_timesteps, self.episodes, mean, time.perf_counter() - self.started))
        with open(self.path, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["timesteps", "episodes", "mean_return", "seconds"])
            writer.writerows((t, e, f"{r:.2f}", f"{s:.2f}") for t, e, r, s in self.rows)


def plot(rows: list, path: Path) -> bool:
    """The curve as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[2] for r in rows])
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean return, last 100 episodes")
    ax.set_title("SB3 PPO on CartPole-v1 through BoltzLabsSB3VecEnv")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the learning curve's CSV (a PNG is drawn beside it)")
    parser.add_argument("--timesteps", type=int, default=50_000)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--n-steps", type=int, default=32, help="steps per env per rollout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # leave the cores to the sandboxes
    venv = VecMonitor(BoltzLabsSB3VecEnv("CartPole-v1", args.n_envs))
    # rl-baselines3-zoo's CartPole-v1 PPO (its learning rate and clip range decay linearly).
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=args.n_steps,
        batch_size=min(256, args.n_steps * args.n_envs),
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=lambda left: left * 1e-3,
        clip_range=lambda left: left * 0.2,
        seed=args.seed,
        device="cpu",
        verbose=0,
    )
    curve = LearningCurve(args.out)
    started = time.perf_counter()
    try:
        model.learn(total_timesteps=args.timesteps, callback=curve)
    finally:
        venv.close()
    seconds = time.perf_counter() - started
    last = curve.rows[-1] if curve.rows else (0, 0, math.nan, 0.0)
    png = args.out.with_suffix(".png")
    drew = plot(curve.rows, png) if curve.rows else False
    print(
        f"{last[0]} steps in {seconds:.1f} s ({last[0] / seconds:.0f} steps/s), {last[1]} episodes; "
        f"mean return of the last 100: {last[2]:.1f}"
    )
    print(f"learning curve: {args.out}" + (f" and {png}" if drew else " (no PNG: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
