"""PPO on CartPole, each env in its own sandbox, through BoltzLabsVecEnv.

    pip install 'boltzlabs[gym]' torch matplotlib
    python examples/ppo_cartpole.py                     # 100k steps, about a minute on a laptop CPU
    python examples/ppo_cartpole.py --steps 50000 --out curve.png

A compact PPO (clipped objective, GAE, one small actor-critic) in the style
of CleanRL's ppo.py. Nothing in it knows about sandboxes: the vector env is
a Gymnasium VectorEnv like any other. It uses SAME_STEP autoreset, so a
finished lane's next observation is already its new episode's, and
bootstraps truncated episodes from infos["final_obs"]. Episode returns come
from boltzlabs' own infos["episode_record"]. Saves the learning curve as a PNG.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from torch import nn

from boltzlabs.gym import BoltzLabsVecEnv


def layer(n_in: int, n_out: int, std: float = np.sqrt(2)) -> nn.Linear:
    linear = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.zeros_(linear.bias)
    return linear


class ActorCritic(nn.Module):
    def __init__(self, n_obs: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0))
        self.actor = nn.Sequential(layer(n_obs, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, n_actions, 0.01))

    def value(self, obs):
        return self.critic(obs).squeeze(-1)

    def act(self, obs, action=None):
        dist = torch.distributions.Categorical(logits=self.actor(obs))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.value(obs)


def train(args) -> tuple[list, list]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # leave the cores to the sandboxes
    envs = BoltzLabsVecEnv.make("CartPole-v1", num_envs=args.envs, autoreset_mode=AutoresetMode.SAME_STEP)
    n, T = envs.num_envs, args.rollout
    agent = ActorCritic(envs.single_observation_space.shape[0], envs.single_action_space.n)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    obs_buf = torch.zeros((T, n, envs.single_observation_space.shape[0]))
    act_buf, logp_buf, rew_buf, done_buf, val_buf = (torch.zeros((T, n)) for _ in range(5))
    curve_steps, curve_returns = [], []

    obs, _ = envs.reset(seed=args.seed)
    obs = torch.as_tensor(obs)
    done = torch.zeros(n)
    step = 0
    updates = args.steps // (n * T)
    started = time.perf_counter()
    for update in range(updates):
        for g in optimizer.param_groups:  # linear learning-rate annealing
            g["lr"] = args.lr * (1.0 - update / updates)
        for t in range(T):
            obs_buf[t], done_buf[t] = obs, done
            with torch.no_grad():
                action, logp, _, value = agent.act(obs)
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            next_obs, reward, terminated, truncated, infos = envs.step(action.numpy())
            step += n
            reward = torch.as_tensor(reward, dtype=torch.float32)
            if truncated.any():  # a time limit is not a failure: bootstrap from the last state
                lanes = np.flatnonzero(truncated & ~terminated)
                if len(lanes):
                    final = torch.as_tensor(np.stack([infos["final_obs"][i] for i in lanes]))
                    with torch.no_grad():
                        reward[lanes] += args.gamma * agent.value(final)
            rew_buf[t] = reward
            obs = torch.as_tensor(next_obs)
            done = torch.as_tensor(terminated | truncated, dtype=torch.float32)
            if "episode_record" in infos:  # some episodes ended on this step
                mask = infos["_episode_record"]
                for ret in infos["episode_record"]["return"][mask]:
                    curve_steps.append(step)
                    curve_returns.append(float(ret))

        # Generalized advantage estimation over the rollout.
        with torch.no_grad():
            next_value = agent.value(obs)
        advantages = torch.zeros((T, n))
        last = torch.zeros(n)
        for t in reversed(range(T)):
            not_done = 1.0 - (done if t == T - 1 else done_buf[t + 1])
            following = next_value if t == T - 1 else val_buf[t + 1]
            delta = rew_buf[t] + args.gamma * following * not_done - val_buf[t]
            last = delta + args.gamma * args.lam * not_done * last
            advantages[t] = last
        returns = advantages + val_buf

        b_obs, b_act, b_logp = obs_buf.reshape(T * n, -1), act_buf.reshape(-1), logp_buf.reshape(-1)
        b_adv, b_ret = advantages.reshape(-1), returns.reshape(-1)
        batch = T * n
        for _ in range(args.epochs):
            order = torch.randperm(batch)
            for start in range(0, batch, batch // args.minibatches):
                idx = order[start : start + batch // args.minibatches]
                _, logp, entropy, value = agent.act(b_obs[idx], b_act[idx].long())
                ratio = (logp - b_logp[idx]).exp()
                adv = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
                value_loss = 0.5 * ((value - b_ret[idx]) ** 2).mean()
                loss = policy_loss + 0.5 * value_loss - args.ent * entropy.mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()

        recent = curve_returns[-20:]
        if (update + 1) % 25 and update + 1 != updates:
            continue
        print(
            f"update {update + 1}/{updates}  steps {step}  "
            f"mean return (last 20 episodes) {np.mean(recent) if recent else float('nan'):.1f}  "
            f"{step / (time.perf_counter() - started):.0f} steps/s",
            flush=True,
        )
    envs.close()
    return curve_steps, curve_returns


def plot(steps, returns, path: Path, envs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(steps, returns, s=4, alpha=0.25, label="episode return")
    if len(returns) >= 20:
        window = 20
        smooth = np.convolve(returns, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, color="C1", linewidth=2, label=f"mean of {window} episodes")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"PPO on CartPole-v1, {envs} envs in bubblewrap sandboxes (BoltzLabsVecEnv)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"learning curve saved to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Defaults: rl-baselines3-zoo's tuned PPO hyperparameters for CartPole-v1.
    parser.add_argument("--steps", type=int, default=100_000, help="total environment steps")
    parser.add_argument("--envs", type=int, default=8, help="sandboxed envs")
    parser.add_argument("--rollout", type=int, default=32, help="steps per env per update")
    parser.add_argument("--lr", type=float, default=1e-3, help="initial learning rate (annealed to 0)")
    parser.add_argument("--gamma", type=float, default=0.98)
    parser.add_argument("--lam", type=float, default=0.8)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--ent", type=float, default=0.0, help="entropy bonus coefficient")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "ppo_cartpole.png")
    args = parser.parse_args()
    steps, returns = train(args)
    plot(steps, returns, args.out, args.envs)


if __name__ == "__main__":
    main()
