"""A Gymnasium env with Graph spaces (issue 43): observations a Dict holding a
Graph with node and edge features, actions a Graph of its own, so GraphInstance
crosses the wire both ways. Its step asserts that the action arrived as a
GraphInstance in the action space, and rewards its nodes' sum.

Imported in process by tests/test_gym_compat.py (for SyncVectorEnv) and
served in each sandbox when run as a script (RLPool(this dir, n)).
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class GraphEnv(gym.Env):
    def __init__(self, horizon=3):
        self.horizon = horizon
        self.graph = spaces.Graph(node_space=spaces.Box(-1.0, 1.0, (3,), np.float32), edge_space=spaces.Discrete(4))
        self.observation_space = spaces.Dict([("graph", self.graph), ("t", spaces.Discrete(horizon + 1))])
        self.action_space = spaces.Graph(node_space=spaces.Discrete(5), edge_space=None)
        self.t = 0

    def _obs(self):
        return {"graph": self.graph.sample(num_nodes=2 + self.t, num_edges=self.t), "t": self.t}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.graph.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        if options and options.get("malformed"):  # what a hostile env could send instead of a graph
            return {"graph": ("not", "a", "graph", "at all"), "t": 0}, {}
        return self._obs(), {}

    def step(self, action):
        assert isinstance(action, spaces.GraphInstance), f"the action arrived as {type(action)}"
        assert action in self.action_space, action
        self.t += 1
        return self._obs(), float(np.sum(action.nodes)), self.t >= self.horizon, False, {"nodes": len(action.nodes)}


if __name__ == "__main__":
    from boltzlabs.env import params, serve_env

    serve_env(GraphEnv(**params()))
