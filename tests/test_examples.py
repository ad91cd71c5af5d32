"""The examples a user looks for first run as they are written (issue 27, "The first hour").

Each runs briefly, in a subprocess as a user would start it: the CleanRL-style PPO on both
vector env classes (the only change between them is the class name, and the same seeds give
the same episodes), SB3's PPO with CnnPolicy on Pong 84x84x4, the main job, and the code RL
driver (examples/code_rl: every attack beside honest lanes; its env's own tests are in
test_code_rl.py).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args, timeout=600) -> str:
    done = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES.parent
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the example needs torch (the test extras)")
def test_the_cleanrl_style_ppo_runs_the_same_on_async_vector_env_and_ours():
    short = ["--total-timesteps", "512", "--num-steps", "64", "--num-envs", "4"]
    ours = run(EXAMPLES / "cleanrl_ppo.py", *short)
    theirs = run(EXAMPLES / "cleanrl_ppo.py", *short, "--vector-env", "async")
    returns = [line for line in ours.splitlines() if line.startswith("global_step=")]
    assert returns, ours  # episodes ended and were counted through RecordEpisodeStatistics inside each env
    assert returns == [line for line in theirs.splitlines() if line.startswith("global_step=")]
    source = (EXAMPLES / "cleanrl_ppo.py").read_text()
    assert re.search(r"VectorEnv = gym\.vector\.AsyncVectorEnv if .* else BoltzLabsVecEnv", source)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("stable_baselines3", "ale_py", "cv2")),
    reason="the example needs stable-baselines3, ale-py and opencv (the test extras)",
)
def test_sb3_ppo_with_cnn_policy_trains_on_pong_84x84x4():
    out = run(EXAMPLES / "sb3_ppo_pong.py", "--timesteps", "64", "--n-envs", "2", "--n-steps", "32")
    assert re.search(r"total_timesteps\s*\|\s*64", out), out
    source = (EXAMPLES / "sb3_ppo_pong.py").read_text()
    assert "BoltzLabsSB3VecEnv([make_env(i, args.seed) for i in range(args.n_envs)])" in source
    assert "screen_size=84" in source and "FrameStackObservation(env, 4)" in source and '"CnnPolicy"' in source


@pytest.mark.parametrize("k", [1, 50])
def test_the_main_job_runs_one_env_or_many_per_sandbox(k):
    out = run(EXAMPLES / "run_pool.py", "-n", "100", "--steps", "120", "--envs-per-sandbox", str(k))
    assert re.search(r"100 sandboxed envs ready in [\d.]+ s" + (r" \(2 sandboxes\)" if k > 1 else "$"), out, re.M), out
    # The counter ends its episodes at t = 100: every env finished one, and reset(where=dones) went on.
    assert "120 steps x 100 envs" in out and "100 episodes finished" in out, out
    assert float(re.search(r"envs_per_gb\(\): ([\d.]+)", out).group(1)) > 0, out


def test_the_code_rl_driver_keeps_every_honest_lane_as_a_clean_pool_has_it():
    # 20 lanes, 13 of them hostile in each episode: every attack in examples/code_rl/solutions.py once per episode.
    out = run(EXAMPLES / "code_rl" / "run.py", "-n", "20", "--hostile", "0.65", "--speed-lanes", "8")
    assert re.search(r"honest episodes: (\d+) checked, 0 with rewards unlike the clean pass's", out), out
    assert int(re.search(r"honest episodes: (\d+) checked", out).group(1)) >= 10, out
    assert "secrets a lane saw that were not its own: 0 steps" in out and "the trainer's files: unchanged" in out, out
    assert re.search(r"reset of all 20 lanes after an attacked episode: scrub [\d.]+ s, hard [\d.]+ s", out), out
    assert re.search(r"after it 0 of 20 \(after the hard reset 0\)", out), out
    for attack in ("fork_bomb", "memory_balloon", "cpu_spin", "background_writer", "trainer_files", "forge_channel"):
        assert re.search(rf"^  {attack} +\S", out, re.M), out
    assert re.search(r"speed variant \(serialize_measurement=True, 8 lanes", out) and out.rstrip().endswith("OK"), out
