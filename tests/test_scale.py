"""A 1000-env pool of the example env: starts, steps, partially resets, closes clean."""

import numpy as np
import pytest

from boltzlabs import RLPool
from conftest import COUNTER, open_fds


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_thousand_envs(spawn):
    n = 1000
    fds = open_fds()
    with RLPool(COUNTER, n, step_timeout=60, spawn=spawn) as pool:
        assert pool.states() == ["idle"] * n
        assert len(set(pool.pids())) == n
        obs = pool.reset(seed=0)
        assert obs == [{"t": 0}] * n
        actions = np.arange(n) % 3
        for _t in range(1, 101):
            obs, rewards, dones, infos = pool.step(actions)
            assert rewards.tolist() == actions.astype(np.float32).tolist()
            assert pool.timing.stragglers == []
        assert dones.all() and obs[n - 1] == {"t": 100}
        mask = np.zeros(n, bool)
        mask[::2] = True
        obs = pool.reset(where=mask)
        assert [o["t"] for o in obs[:4]] == [0, 100, 0, 100]
        memory = pool.memory()
        assert len(memory.per_env) == n and all(m > 0 for m in memory.per_env)
        assert pool.envs_per_gb() > 50
        pids = pool.pids()
        pool.reset(hard=True, seed=0)
        assert not set(pids) & set(pool.pids())
        assert pool.step(actions)[0] == [{"t": 1}] * n
    assert open_fds() == fds
