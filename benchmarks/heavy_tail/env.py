"""A heavy-tailed env for bench_async.py: each step sleeps 1 ms, or 50 ms one time in a hundred."""

import random
import time

from boltzlabs.env import serve

rng = random.Random()


def reset(seed):
    global rng
    rng = random.Random(seed)
    return 0


def step(action):
    time.sleep(0.05 if rng.random() < 0.01 else 0.001)
    return 0, 1.0, False, {}


serve(reset=reset, step=step)
