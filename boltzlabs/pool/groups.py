"""Several envs per sandbox: `RLPool(source, n, envs_per_sandbox=k)`, the trainer's half.

    GroupedPool (n envs) --one request per group: each member's entry--> inner pool (ceil(n / k) lanes:
        RLPool or ShardedPool, each lane one sandbox running runtime/group.py)
    GroupedPool <--each group's one reply: [kinds, rewards, terminated, truncated, infos, errors]--

The inner pool is an ordinary pool whose lanes are the groups' sandboxes: the
worker, its lane state machine, the sandbox recipe, the slots, the cgroups and
the deadlines are the same for a group of one and a group of k. This module
maps env i to lane i // k and member i % k, fans every call out as one entry
per member and takes each group's reply apart, checking it first: a group's
reply is its env code's output, and a group that answers for members it does
not have, with the wrong counts or types, fails each of its envs (named) and
is respawned at their next reset.

What fails where: an exception in one env's reset or step fails that env
only; anything the worker sees (the group's process died, was OOM-killed,
missed its deadline, sent a bad frame) fails every env of the group, each
with the cause and the group's other envs named. A hard reset (and the reset
of an env whose group died) respawns the whole group: its other envs are
reset too, and `reset_infos[i]["group_reset"]` says why.

Imports nothing of client.py (which imports this): the inner pool comes made.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from boltzlabs import wire
from boltzlabs.errors import EnvStartError, ProtocolError
from boltzlabs.pool.protocol import Pool, RecvResult, StepResult, attr_error, raise_unserializable

# One msgpack value as a message wire.decode takes: [REPLY, value] (a two-item array and its code).
_ONE_VALUE = b"\x92" + bytes([wire.REPLY])

# runtime/group.py's, repeated: the trainer imports nothing of the sandbox's modules.
GROUP_KEY = "boltzlabs.group"
NOT_ASKED, STEPPED, RESET = -1, 0, 1


def group_size(envs_per_sandbox, vectorization_mode, n: int) -> int:
    """k from RLPool(envs_per_sandbox=, vectorization_mode=): 1 (a sandbox per env) by default.

    vectorization_mode is Gymnasium's and rlmesh's spelling: "sync" steps every env in one
    sandbox (k = n), "async" gives each its own (k = 1); envs_per_sandbox, when given, decides."""
    if vectorization_mode is not None:
        if vectorization_mode not in ("sync", "async"):
            raise ValueError(
                f"vectorization_mode must be 'sync' (every env in one sandbox) or 'async' (a sandbox "
                f"per env), not {vectorization_mode!r}; envs_per_sandbox=k chooses any size in between"
            )
        if envs_per_sandbox is None:
            envs_per_sandbox = n if vectorization_mode == "sync" else 1
    if envs_per_sandbox is None:
        return 1
    if (
        isinstance(envs_per_sandbox, bool)
        or not isinstance(envs_per_sandbox, (int, np.integer))
        or envs_per_sandbox < 1
    ):
        raise ValueError(f"envs_per_sandbox must be a whole number >= 1, not {envs_per_sandbox!r}")
    return min(int(envs_per_sandbox), n)


class GroupedPool(Pool):
    """n envs in ceil(n / k) sandboxes of k envs each (the last holds the rest), behind one step.

    Made by `RLPool(source, n, envs_per_sandbox=k)` for k > 1; every call keeps its meaning
    (docs/groups.md). `envs_per_sandbox` is k, `sandboxes` the number of groups, `inner` the
    pool whose lanes are the groups' sandboxes."""

    def __init__(self, make_inner, n: int, k: int, batch_size=None):
        self.k = self.envs_per_sandbox = k
        self.sandboxes = -(-n // k)
        try:
            self.inner = make_inner(self.sandboxes, [k, n])
        except EnvStartError as exc:
            # The inner pool names the sandbox as its lane ("env g"): say which envs those are.
            g = exc.env_index
            if g is None or not 0 <= g < self.sandboxes:
                raise
            first, last = g * k, min(n, (g + 1) * k) - 1
            raise EnvStartError(
                f"sandbox {g} (envs {first}-{last}, envs_per_sandbox={k}) failed to start; below, 'env {g}' "
                f"is that sandbox (its output names which of its envs failed): {exc}",
                log=exc.log,
            ) from exc
        self._init_lanes(n)
        self._all_stepped = [[STEPPED] * len(self.members(g)) for g in range(self.sandboxes)]  # kinds: read only
        self._sent_stepped = bytes([STEPPED] * n)  # the same, one byte per env, as Batch.groups takes it
        inner = self.inner
        self.source = inner.source
        self.batch_size = batch_size
        contract = inner.env_contract
        group = (inner.hello or {}).get("group") or {}
        self.env_contract = dataclasses.replace(
            contract,
            observation_space=group.get("observation_space"),
            action_space=group.get("action_space"),
        )
        self.hello = dict(
            inner.hello or {}, observation_space=group.get("observation_space"), action_space=group.get("action_space")
        )
        self.timing = inner.timing
        self.max_str_len = inner.max_str_len  # each env's str cap is its sandbox's
        if hasattr(inner, "direct"):
            # A local pool of sandboxes steps them itself while its worker lends their channels
            # (docs/native-step.md#the-direct-step): one hop each way instead of two.
            inner.direct = True
        # group -> the kind sent to each member (NOT_ASKED: not sent), until the group's result is taken
        self._in_flight: dict[int, list[int]] = {}
        self._held: list[tuple] = []  # (env, obs, reward, terminated, truncated, info): finished, not yet received
        self._respawn: set[int] = set()  # groups that sent an invalid reply: respawned at their next reset
        # (the last step's infos, each group's info columns, the groups' whose member infos are not
        # made yet) while every group sent columns; else None (batched_infos)
        self._columns: tuple | None = None
        self._obs_batch: tuple | None = None  # (the last step's obs, their one array) or None (batched_obs)

    # -- what the inner pool says of itself -------------------------------------------

    def __getattr__(self, name):
        # spawn, fast_path, channel, shared_memory, workers, affinity, step_timeout, memory_source,
        # worker: the inner pool's, which are the groups' (only names not set here reach this).
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def members(self, group: int) -> range:
        """The envs of sandbox `group`."""
        return range(group * self.k, min(self.n, (group + 1) * self.k))

    def _named(self, group: int) -> str:
        envs = self.members(group)
        return f"sandbox {group} (envs {envs.start}-{envs.stop - 1}, envs_per_sandbox={self.k})"

    # -- the hooks ------------------------------------------------------------------

    def _check_open(self) -> None:
        self.inner._check_open()

    def _step_lanes(self, actions: list, resets) -> StepResult:
        self._refuse_async("step() cannot run")
        k = self.k
        kinds: list[list[int]] = self._all_stepped  # the kind sent to each member: every env steps
        if resets:  # but these reset instead
            kinds = [list(sent) for sent in kinds]
            for i in resets:
                kinds[i // k][i % k] = RESET
        packed = _packed_rows(actions, k, self._action_rows, kinds if resets else None)
        if packed is None:
            entries = [
                [[RESET, None, None] if kind == RESET else [STEPPED, actions[g * k + j]] for j, kind in enumerate(sent)]
                for g, sent in enumerate(kinds)
            ]
            packed = _packed(entries, actions, range(len(actions)))
        taken: list = []
        if getattr(self.inner, "direct", False):  # a local pool that may step its sandboxes itself

            def read_whole(batch, seq: int):
                step = self._read_whole(batch, seq, kinds, resets)
                if step is not None:
                    taken.append(step)
                return step

            result = self.inner._step_lanes(packed, None, read_whole)
            if taken:
                return taken[0]
        else:
            result = self.inner._step_lanes(packed, None)
        n = self.n
        obs: list = [None] * n
        # Lists while the groups' replies go in (by slices), arrays at the end: one conversion each.
        rewards: list = [0.0] * n
        terminated: list = [False] * n
        truncated: list = [False] * n
        infos: list = [None] * n
        columns: list | None = []  # each group's info columns, while every group's came so
        unmade: list = []  # (first env, info columns) of the groups whose members' infos are not made yet
        whole = 0  # groups that went in by slices
        for g in range(self.sandboxes):
            sent = kinds[g]
            # Hot path: a group whose every env stepped without error, checked with whole-list
            # operations, goes in by slices; anything else member by member (_take's full check).
            group_infos = _stepped_whole(result.obs[g], result.infos[g], sent)
            if group_infos is not None:
                start, count = g * k, len(sent)
                whole += 1
                _, group_rewards, group_terminated, group_truncated, _, _ = result.infos[g][GROUP_KEY]
                stop = start + count
                rewards[start:stop] = group_rewards
                terminated[start:stop] = group_terminated
                truncated[start:stop] = group_truncated
                if sent is not self._all_stepped[g]:  # a reset's reward and flags: ours, whatever it sent
                    for j, kind in enumerate(sent):
                        if kind == RESET:
                            rewards[start + j], terminated[start + j], truncated[start + j] = 0.0, False, False
                group_obs = result.obs[g]
                obs[start:stop] = list(group_obs[:count]) if type(group_obs) is not dict else _rows_of(group_obs, count)
                columns = _put_infos(infos, start, group_infos, columns, unmade)
                continue
            columns = None
            for i, o, r, te, tr, info in self._take(g, result.obs[g], result.infos[g], sent):
                obs[i], rewards[i], terminated[i], truncated[i], infos[i] = o, r, te, tr, info
        batch = None
        if whole == self.sandboxes:
            # The groups' slot batch, a (groups, k, ...) array: its first n rows are the envs' obs.
            batch = self.inner.batched_obs(result.obs)
            if batch is not None and (batch.ndim < 2 or batch.shape[:2] != (self.sandboxes, k)):
                batch = None
        return self._stepped(
            obs,
            np.array(rewards, np.float64),
            np.array(terminated, np.bool_),
            np.array(truncated, np.bool_),
            infos,
            columns,
            unmade,
            batch,
        )

    def _read_whole(self, batch, seq: int, kinds: list, resets) -> StepResult | None:
        """THE HOT PATH of a grouped step: the direct step's Batch (native/fastpath.c) read whole
        in C (Batch.groups: each env's reward and flags into the arrays, with the checks
        _stepped_whole makes), the obs rows copied from the slots once, the infos decoded only
        where some member's is not empty. None, with nothing changed, when any group answered
        otherwise or its obs is not in its slot: the reply is then decoded and checked group by
        group (_step_lanes), as where there is no C."""
        slots = self.inner._slots
        if slots is None:
            return None
        n, k, count = self.n, self.k, self.sandboxes
        sent: bytes | bytearray
        if resets:
            sent = bytearray(n)
            for i in resets:
                sent[i] = RESET
        else:
            sent = self._sent_stepped
        rewards = np.empty(n, np.float64)
        terminated = np.empty(n, np.bool_)
        truncated = np.empty(n, np.bool_)
        spans = batch.groups(sent, k, rewards, terminated, truncated)
        if spans is None:
            return None
        rows = slots.rows(count, seq)
        if rows is None or rows.ndim < 2 or rows.shape[:2] != (count, k):
            return None
        infos: list = [None] * n
        columns: list | None = []
        unmade: list = []
        limits = self.inner._reader.limits
        for g, span in enumerate(spans):
            start = g * k
            size = len(kinds[g])
            if span is None:  # every member's info empty
                infos[start : start + size] = [{} for _ in range(size)]
                columns = None
                continue
            try:
                group_infos = wire.decode(_ONE_VALUE + span, limits)[1]
            except ProtocolError:  # the decoded path meets it too, and says so as ever
                return None
            if not _infos_whole(group_infos, size):
                return None
            columns = _put_infos(infos, start, group_infos, columns, unmade)
        obs = list(rows.reshape(count * k, *rows.shape[2:])[:n])
        return self._stepped(obs, rewards, terminated, truncated, infos, columns, unmade, rows)

    def _stepped(self, obs, rewards, terminated, truncated, infos, columns, unmade, batch) -> StepResult:
        """A step's results, every group's in: the infos made now unless the caller asked for them
        lazily and every group sent columns; `batch`: the groups' (groups, k, ...) slot batch when
        every obs is a row of it (batched_obs), else None."""
        self._columns = (infos, columns, unmade) if columns else None
        if not (columns and self._lazy_infos):  # step_full(lazy_infos=True): made when batched_infos cannot
            _make_infos(infos, unmade)
        self._obs_batch = None
        if batch is not None:
            self._obs_batch = (obs, batch.reshape(self.sandboxes * self.k, *batch.shape[2:])[: self.n])
        stragglers = self.inner.timing.stragglers
        self._stragglers([i for g in stragglers for i in self.members(g)] if stragglers else [])
        return StepResult(obs, rewards, terminated, truncated, infos)

    def _take(self, group: int, obs, info, sent: list):
        """Each member's (env, obs, reward, terminated, truncated, info) from group's reply (its
        obs and info as the inner pool gave them); `sent`: the kind sent to each member (NOT_ASKED:
        none), which each member asked must answer with, and which fail with it when its reply is invalid."""
        envs = self.members(group)
        count = len(envs)
        results = info.get(GROUP_KEY) if type(info) is dict and "error" not in info else None
        why = ""
        if results is None:
            said = info.get("error") if type(info) is dict else None
            why = said if isinstance(said, str) else f"sent {type(info).__name__} where a group's reply goes"
            # The worker's failures (died, missed its deadline) look so, and so can the group's own
            # reply: either way it is respawned at its next reset, never trusted to go on.
            self._respawn.add(group)
        else:
            if type(results) is list and len(results) == 6 and type(results[4]) is dict:
                columns = _from_columns(results[4], count)
                if columns is not None:
                    results = [*results[:4], columns, results[5]]
            why = _check(results, obs, count, sent)
            if why:
                why = f"sent an invalid group reply ({why}); it is respawned at its next reset"
                self._respawn.add(group)
        if why or results is None:
            straggler = type(info) is dict and info.get("straggler") is True
            budget = type(info) is dict and info.get("cpu_budget") is True
            for j in range(count):
                if sent[j] == NOT_ASKED:
                    continue
                failure = {"error": f"{why} [{self._named(group)}: every env of it fails with it]", "group": group}
                if straggler:
                    failure["straggler"] = True
                if budget:  # the sandbox, all its envs' work, was killed over its cpu_budget
                    failure["cpu_budget"] = True
                yield envs.start + j, None, 0.0, False, True, failure
            return
        kinds, rewards, terminated, truncated, member_infos, errors = results
        for j in range(count):
            if kinds[j] == NOT_ASKED:
                continue
            error = errors[j]
            if error is not None:
                yield envs.start + j, None, 0.0, False, True, {"error": error[2] or error[1]}
            elif kinds[j] == STEPPED:
                yield (
                    envs.start + j,
                    _row(obs, j),
                    float(rewards[j]),
                    terminated[j],
                    truncated[j],
                    member_infos[j] or {},
                )
            else:
                yield envs.start + j, _row(obs, j), 0.0, False, False, member_infos[j] or {}

    def batched_infos(self, infos: list):
        """The vector infos of the last step from its groups' info columns (runtime/group.py's
        info_columns), when `infos` are that step's and every group sent columns of the same keys
        in the same order, each of one numeric dtype: what gym.py's _batch_infos makes of the n
        dicts, without making it again. None otherwise (_batch_infos decides, as for any pool)."""
        held = self._columns
        if held is None or held[0] is not infos:
            return None
        out = _batched_columns(held[1], self.n)
        if out is None:  # the members' infos, for the caller to batch: made now if they were left
            _make_infos(infos, held[2])
            self._columns = None
        return out

    def batched_obs(self, obs: list):
        """The (n, ...) read-only array whose rows are `obs`, when `obs` are the last step's and
        came whole from the groups' slots (a Box space): the batch the slots were copied into,
        which a vector env returns (a copy of) without stacking the rows again. None otherwise."""
        held = self._obs_batch
        return held[1] if held is not None and held[0] is obs else None

    def _stragglers(self, envs: list) -> None:
        """timing.stragglers in envs: those of this call's results whose group missed its deadline.
        Set from this call's own results, never from the inner pool's list as it stands, which is
        in sandboxes and is left as it was by a recv that the held results answer whole."""
        timing = self.inner.timing
        self.timing = timing
        timing.stragglers = envs

    def _reset_lanes(self, lanes: list, seeds, hard: bool, options, scrub: bool = False) -> tuple:
        k = self.k
        tables: dict[int, list] = {}
        for pos, i in enumerate(lanes):
            tables.setdefault(i // k, []).append([i % k, None if seeds is None else seeds[pos], options])
        groups = sorted(tables)
        for g in groups:
            self._refuse_busy(g, "reset")
            self._refuse_held(g)
        respawn = [g for g in groups if hard or g in self._respawn]
        soft = [g for g in groups if g not in respawn]
        wanted = set(lanes)
        taken: dict[int, tuple] = {}
        for chosen, how in ((respawn, True), (soft, False)):
            if not chosen:
                continue
            # A scrub empties the sandbox every member shares: each member resets (runtime/group.py).
            obs, infos = self.inner._reset_lanes(chosen, [tables[g] for g in chosen], how, None, scrub and not how)
            for pos, g in enumerate(chosen):
                self._respawn.discard(g)
                sent = [NOT_ASKED] * len(self.members(g))
                for item in tables[g]:
                    sent[item[0]] = RESET
                # A respawned group resets every member, asked or not: the others come back reset too.
                for i, o, _, _, _, info in self._take(g, obs[pos], infos[pos], sent):
                    if i in wanted:
                        taken[i] = (o, info)
                    elif "error" not in info:
                        self._sibling_reset(i, o, info, g, lanes, "respawned" if how else "scrubbed")
        obs_out = [taken.get(i, (None, {"error": "no reply"}))[0] for i in lanes]
        infos_out = [taken.get(i, (None, {"error": "no reply"}))[1] for i in lanes]
        self._stragglers(
            [i for i, o, info in zip(lanes, obs_out, infos_out) if o is None and info.get("straggler") is True]
        )
        return obs_out, infos_out

    def _sibling_reset(self, i: int, obs, info, group: int, lanes: list, why: str) -> None:
        """Env i was reset with its group (respawned or scrubbed), though not asked for: its new
        episode, said so."""
        info = dict(info)
        info["group_reset"] = (
            f"reset with {self._named(group)}, which was {why} to reset env(s) "
            f"{', '.join(map(str, [j for j in lanes if j // self.k == group][:8]))}"
        )
        self._obs = list(self._obs)
        self.reset_infos = list(self.reset_infos)
        self._obs[i], self.reset_infos[i] = obs, info
        self.terminated = self.terminated.copy()
        self.truncated = self.truncated.copy()
        self.terminated[i] = self.truncated[i] = False
        self._pending_resets.discard(i)
        self._begin_episodes([i], None)

    def _refuse_async(self, what: str) -> None:
        """ValueError while a send's result is outstanding, here or in the inner pool (step() does not
        mix with send/recv): a step run under a held result would leave it stale for a later recv."""
        flying = self._flying()
        if flying or self._held:
            raise ValueError(
                f"{what} while {flying} env(s) are in flight and {len(self._held)} finished but not "
                "received: recv them first (send/recv and step() do not mix)"
            )

    def _flying(self) -> int:
        """How many envs are in flight (sent, their group's result not taken)."""
        return sum(len(kinds) - kinds.count(NOT_ASKED) for kinds in self._in_flight.values())

    def _refuse_held(self, group: int) -> None:
        """ValueError when an env of `group` has a result recv() has not taken: a reset may respawn
        the whole sandbox, and that result would then come after the reset, stale."""
        held = sorted(entry[0] for entry in self._held if entry[0] // self.k == group)
        if held:
            raise ValueError(
                f"cannot reset env(s) of {self._named(group)}: env {held[0]} has finished and its result "
                "has not been received; recv it first"
            )

    def _refuse_busy(self, group: int, what: str) -> None:
        if group in self._in_flight:
            raise ValueError(
                f"{what} of env(s) in {self._named(group)}, whose step is in flight: recv() it first "
                "(the envs of one sandbox are stepped in one turn)"
            )

    def _send_lanes(self, actions: list, lanes: list, resets, how=None) -> None:
        k, reset_set = self.k, set(resets or ())
        seeds, options, scrub = how if how is not None else (None, None, False)
        seed_of = dict(zip(resets, seeds)) if seeds is not None else {}
        held = {entry[0] for entry in self._held}
        entries: dict[int, list] = {}
        for i, action in zip(lanes, actions):
            g = i // k
            if g not in entries:
                self._refuse_busy(g, "send()")
                entries[g] = [None] * len(self.members(g))
            if i in held:
                raise ValueError(f"send(): env {i} has a result not yet received; recv() it first")
            entries[g][i % k] = [RESET, seed_of.get(i), options] if i in reset_set else [STEPPED, action]
        groups = sorted(entries)
        # A scrub empties the sandbox every member shares, so it resets them all: a sandbox is scrubbed
        # in flight only when every env of it is among the resets (its one turn is that reset).
        scrubbed = [g for g in groups if scrub and any(e is not None and e[0] == RESET for e in entries[g])]
        for g in scrubbed:
            if not all(e is not None and e[0] == RESET for e in entries[g]):
                raise ValueError(
                    f"send(scrub=True) resets whole sandboxes, and {self._named(g)} has envs not among the "
                    "resets: put every env of it in resets, or use reset(where=..., scrub=True)"
                )
        inner_how = None
        if scrubbed:  # the sandbox's RESET carries its members' table as its seed (runtime/group.py)
            inner_how = [[[[j, e[1], e[2]] for j, e in enumerate(entries[g])] for g in scrubbed], None, True]
        self.inner._send_lanes(
            _packed([entries[g] for g in groups], actions, lanes), groups, scrubbed or None, inner_how
        )
        for g in groups:
            self._in_flight[g] = _kinds(entries[g])

    def _recv_lanes(self, batch_size, timeout) -> RecvResult:
        sent = self._flying()
        want = len(self._held) + sent if batch_size is None else batch_size
        if want > len(self._held) + sent:
            raise ValueError(
                f"recv(batch_size={batch_size}): only {len(self._held) + sent} env(s) are in flight or finished"
            )
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while len(self._held) < want and self._in_flight:
            need = want - len(self._held)
            groups = min(len(self._in_flight), max(1, -(-need // self.k)))
            left = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            result = self.inner._recv_lanes(groups, left)
            for pos, g in enumerate(result.env_ids.tolist()):
                kinds = self._in_flight.pop(g)
                for i, o, r, te, tr, info in self._take(g, result.obs[pos], result.infos[pos], kinds):
                    if kinds[i % self.k] != NOT_ASKED:
                        self._held.append((i, o, r, te, tr, info))
            if len(result.env_ids) < groups:
                break  # the timeout passed
        taken, self._held = self._held[:want], self._held[want:]
        self._stragglers([t[0] for t in taken if t[1] is None and t[5].get("straggler") is True])
        return RecvResult(
            np.array([t[0] for t in taken], np.int64),
            [t[1] for t in taken],
            np.array([t[2] for t in taken], np.float64),
            np.array([t[3] for t in taken], np.bool_),
            np.array([t[4] for t in taken], np.bool_),
            [t[5] for t in taken],
        )

    def _render_lanes(self, lanes: list) -> list:
        from boltzlabs.errors import EnvError

        groups = sorted({i // self.k for i in lanes})
        frames, errors = self.inner._render_request(groups)
        errors = {int(g): error for g, error in errors.items()}  # the sandbox's own: dead, ...
        by_group = dict(zip(groups, frames))
        out = []
        for i in lanes:
            g = i // self.k
            if g in errors:
                raise EnvError(f"env {i} could not render: {errors[g]} [{self._named(g)}]", env_index=i)
            ok, value = _member_item(by_group[g], i % self.k, len(self.members(g)))
            if not ok:
                raise EnvError(f"env {i} could not render: {_failure_text(value)}", env_index=i)
            out.append(value)
        return out

    def _log(self, index: int) -> str:
        return self.inner._log(index // self.k)

    def _attr(self, op: str, name, env_ids, args: list, kwargs: dict, values=None) -> list:
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        self.inner._attr_check(op, name)
        if not lanes:
            return []
        tables: dict[int, list] = {}
        for pos, i in enumerate(lanes):
            tables.setdefault(i // self.k, []).append([i % self.k, [values[pos]] if values is not None else args])
        groups = sorted(tables)
        verb = {"call": "call", "get": "get the attribute", "set": "set the attribute"}[op]
        results, errors = self.inner._attr_request(groups, op, name, [], kwargs, [tables[g] for g in groups])
        by_group = dict(zip(groups, results))
        failed: dict[int, tuple] = {}
        out: list = []
        for i in lanes:
            g = i // self.k
            if g in errors:
                where = f" [{self._named(g)}]"
                message, detail = errors[g]
                failed[i] = (message + where, detail and detail + where)
                out.append(None)
                continue
            ok, value = _member_item(by_group[g], i % self.k, len(self.members(g)))
            if not ok:
                failed[i] = tuple(value) if isinstance(value, list) and len(value) == 2 else (str(value), "")
            out.append(value if ok else None)
        if failed:
            raise attr_error(verb, name, failed)
        return out

    def memory(self):
        """Each env's share of its sandbox's memory (the group's, kernel-accounted, over its envs)."""
        report = self.inner.memory()
        per_env = []
        for g, value in enumerate(report.per_env):
            count = len(self.members(g))
            per_env += [value / count] * count
        return dataclasses.replace(report, per_env=per_env)

    def states(self) -> list:
        groups = self.inner.states()
        shown = [groups[i // self.k] for i in range(self.n)]
        for g, kinds in self._in_flight.items():
            for j, kind in enumerate(kinds):
                if kind == NOT_ASKED and shown[g * self.k + j] in ("in_flight", "finished"):
                    shown[g * self.k + j] = "idle"
        for entry in self._held:
            shown[entry[0]] = "finished"
        return shown

    def pids(self) -> list:
        pids = self.inner.pids()
        return [pids[i // self.k] for i in range(self.n)]

    def shutdown(self, reason: str = "owner shutdown") -> bool:
        return self.inner.shutdown(reason)

    def close(self) -> None:
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def __repr__(self) -> str:
        return f"<GroupedPool {self.source!r} n={self.n} envs_per_sandbox={self.k} ({self.sandboxes} sandboxes)>"


def _row(obs, j: int):
    """Member j's obs from its group's: a row of the slot's batch (an array, or a dict or tuple of
    them), or an item of the list that came by the wire."""
    if type(obs) is list:
        return obs[j]
    if isinstance(obs, np.ndarray):
        return obs[j]
    if type(obs) is dict:
        return {key: _row(value, j) for key, value in obs.items()}
    if type(obs) is tuple:
        return tuple(_row(value, j) for value in obs)
    return None


def _rows(obs) -> int:
    """How many members' obs a group's obs holds (-1: not a group's obs)."""
    if type(obs) is list:
        return len(obs)
    if isinstance(obs, np.ndarray):
        return obs.shape[0] if obs.ndim else -1
    if type(obs) in (dict, tuple) and obs:
        counts = {_rows(value) for value in (obs.values() if type(obs) is dict else obs)}
        return counts.pop() if len(counts) == 1 else -1
    return -1


_INT = frozenset((int,))
_NUMBERS = frozenset((int, float))
_BOOL = frozenset((bool,))
_INFO = frozenset((dict, type(None)))


def _columns_of(columns: dict, count: int) -> bool:
    """Whether a group's info columns (runtime/group.py's info_columns: {key: array of one value
    per member}) are `count` members': each key a str and each column a 1-D array of `count`
    items (the wire's checks made it numeric)."""
    return bool(columns) and all(
        type(key) is str and type(column) is np.ndarray and column.ndim == 1 and column.shape[0] == count
        for key, column in columns.items()
    )


def _from_columns(columns: dict, count: int) -> list | None:
    """Each member's info from a group's info columns, each value the numpy scalar it was in the
    env; None unless _columns_of says they are `count` members'."""
    if not _columns_of(columns, count):
        return None
    return _member_dicts(columns)


def _member_dicts(columns: dict) -> list:
    """Each member's info of columns _columns_of accepted: {key: its item}, in the columns' order."""
    keys = list(columns)
    return [dict(zip(keys, row)) for row in zip(*columns.values())]


def _make_infos(infos: list, unmade: list) -> None:
    """Fill in `infos` the members' dicts of each (first env, checked info columns) in `unmade`."""
    for start, columns in unmade:
        made = _member_dicts(columns)
        infos[start : start + len(made)] = made
    unmade.clear()


def _batched_columns(groups: list, n: int) -> dict | None:
    """Gymnasium's vector infos of n envs from their groups' info columns, as gym.py's
    _batch_infos makes them of the n dicts: when every group sent the same keys in the same
    order, each key's columns of one numeric dtype. None otherwise."""
    keys = list(groups[0])
    if "final_obs" in keys or any(list(group) != keys for group in groups):
        return None
    masks = np.ones((len(keys), n), dtype=np.bool_)  # each key's mask a row of it: one allocation
    out = {}
    for key, mask in zip(keys, masks):
        parts = [group[key] for group in groups]
        dtype = parts[0].dtype
        # _batch_infos batches numbers (np.number's types) and leaves numpy bools to _add_info
        if dtype.kind not in "iufc" or any(part.dtype != dtype for part in parts):
            return None
        out[key] = np.concatenate(parts)
        out[f"_{key}"] = mask
    return out


def _stepped_whole(obs, info, sent: list) -> list | dict | None:
    """The members' infos (a list as sent, or the info columns, checked: _make_infos makes
    each member's dict of them) when a group's reply is the plain one to a turn of all its envs:
    each env stepped or reset as sent, none failed, every field of the right type and count, obs rows for each (an
    array or a dict of arrays from the slot, or a list by the wire). What _check accepts, by
    whole-list operations; None sends the reply through _take, which checks it member by member
    and names what is wrong."""
    count = len(sent)
    if type(info) is not dict or len(info) != 1:
        return None
    results = info.get(GROUP_KEY)
    if type(results) is not list or len(results) != 6:
        return None
    kinds, rewards, terminated, truncated, infos, errors = results
    if not (
        type(kinds) is list
        and kinds == sent
        and NOT_ASKED not in sent
        and _column(kinds, count, _INT)
        and _column(rewards, count, _NUMBERS)
        and _column(terminated, count, _BOOL)
        and _column(truncated, count, _BOOL)
        and _infos_whole(infos, count)
        and type(errors) is list
        and errors.count(None) == count == len(errors)
    ):
        return None
    if isinstance(obs, np.ndarray):
        whole = obs.ndim > 0 and obs.shape[0] >= count
    elif type(obs) is list:
        whole = len(obs) == count
    else:
        whole = type(obs) is dict and _rows(obs) >= count
    if not whole:
        return None
    return infos


def _infos_whole(infos, count: int) -> bool:
    """Whether a group's infos item is `count` members' (a dict or None each), or info columns
    _columns_of accepts."""
    return _columns_of(infos, count) if type(infos) is dict else _column(infos, count, _INFO)


def _put_infos(infos: list, start: int, group_infos, columns: list | None, unmade: list) -> list | None:
    """A whole group's infos (checked: _infos_whole) in `infos` from `start`: its columns left in
    `unmade` for _make_infos, or each member's dict ({} for None). The columns of the groups so
    far, with this one's, while every group sent columns; else None."""
    if type(group_infos) is dict:
        unmade.append((start, group_infos))
        if columns is not None:
            columns.append(group_infos)
        return columns
    infos[start : start + len(group_infos)] = group_infos if None not in group_infos else [x or {} for x in group_infos]
    return None


def _column(values, count: int, types: frozenset) -> bool:
    """Whether values is a list of `count` items, each of one of `types` (exactly)."""
    return type(values) is list and len(values) == count and set(map(type, values)) <= types


def _rows_of(obs: dict, count: int) -> list:
    return [_row(obs, j) for j in range(count)]


def _packed(entries: list, actions: list, envs) -> list:
    """Each group's entries as one msgpack bin, which the worker passes on as that group's action
    without decoding it (runtime/group.py decodes it): a grouped step's actions are decoded once,
    in the sandbox, not in the worker too. TypeError naming the env whose action cannot be sent."""
    try:
        return [wire.pack([wire.STEP, group]) for group in entries]  # a message, as wire.decode takes one
    except (TypeError, ValueError, OverflowError):
        raise_unserializable(actions, envs)
        raise


def _packed_rows(actions: list, k: int, given: np.ndarray | None = None, kinds: list | None = None) -> list | None:
    """Each group's actions as one array, a row per member (runtime/group.py gives each member its
    row), when every action is a numpy array of one shape and one numeric dtype (a Box's), or
    a numpy scalar of one type (a Discrete's, from the adapter): one array to pack and decode
    per group, not k. `given`: the (n, ...) array whose rows `actions` are, when they came so
    (Pool._action_rows; its items, a 1-d array's, under step_full(array_items=True)): its slices
    are packed as they are. `kinds`: the kind sent to each
    member of each group, when some reset instead (their row unused): each group's list of
    them goes third. None otherwise (_packed: an entry per member)."""
    if not actions:
        return None
    first = actions[0]
    kind = type(first)
    if given is not None and given.dtype.kind in "biuf":
        rows = given  # actions is list(given): its rows, or its items, of one shape and dtype
    elif kind is not np.ndarray:
        if not issubclass(kind, np.generic) or first.dtype.kind not in "biuf":
            return None
        if set(map(type, actions)) != {kind}:
            return None
        rows = np.array(actions)  # a 1-D array of their one dtype; each member gets its item back
        if rows.dtype != first.dtype:
            return None
    elif first.ndim == 0 or first.dtype.kind not in "biuf":
        return None
    else:
        shape, dtype = first.shape, first.dtype
        for action in actions:
            if (
                type(action) is not np.ndarray
                or action.shape != shape
                or (action.dtype is not dtype and action.dtype != dtype)
            ):
                return None
        rows = np.array(actions)  # the same dtype and shape, checked above: np.stack's result, faster
    messages = [[wire.STEP, rows[g : g + k]] for g in range(0, len(actions), k)]
    for message, sent in zip(messages, kinds or ()):
        reset = [j for j, kind in enumerate(sent) if kind == RESET]
        if reset:
            message.append(reset)
    try:
        return [wire.pack(message) for message in messages]
    except (TypeError, ValueError, OverflowError):
        return None


def _kinds(entries: list) -> list[int]:
    """The kind sent to each member in `entries` (NOT_ASKED for None)."""
    return [NOT_ASKED if entry is None else entry[0] for entry in entries]


def _check(results, obs, count: int, sent: list) -> str:
    """'' when a group's results are what runtime/group.py sends for `count` members sent the
    kinds `sent` (STEPPED, RESET or NOT_ASKED), else what is wrong: each member asked answers
    with the kind it was sent, and no other member answers as stepped."""
    if type(results) is not list or len(results) != 6:
        return "its results are not the six lists a group sends"
    if type(results[4]) is dict:  # columns _from_columns did not take
        return f"its info columns are not one array of {count} numbers under each str key"
    if not all(type(part) is list and len(part) == count for part in results):
        return f"its results do not hold exactly {count} items each, one per env of the group"
    kinds, rewards, terminated, truncated, infos, errors = results
    rows = _rows(obs)
    if type(obs) is list and rows != count or type(obs) is not list and rows < count:
        return f"its observations hold {rows} rows for {count} envs"
    for j in range(count):
        if type(kinds[j]) is not int or kinds[j] not in (NOT_ASKED, STEPPED, RESET):
            return f"member {j}'s kind is {kinds[j]!r:.40}"
        if type(rewards[j]) not in (int, float) or type(terminated[j]) is not bool or type(truncated[j]) is not bool:
            return f"member {j}'s reward or done flags are not a number and bools"
        if infos[j] is not None and type(infos[j]) is not dict:
            return f"member {j}'s info is a {type(infos[j]).__name__}, not a dict"
        error = errors[j]
        if error is not None and (type(error) is not list or len(error) != 3 or not all(type(e) is str for e in error)):
            return f"member {j}'s error is not [phase, message, traceback]"
    # Every member asked answers as asked; one not asked was not stepped (a fresh process resets them all).
    for j in range(count):
        if sent[j] != NOT_ASKED and kinds[j] == NOT_ASKED:
            return f"member {j} was asked and not answered"
        if sent[j] == NOT_ASKED and kinds[j] == STEPPED:
            return f"member {j} was not asked and answered as stepped"
        if sent[j] != NOT_ASKED and kinds[j] != sent[j]:
            return f"member {j} was sent kind {sent[j]} and answered kind {kinds[j]}"
    return ""


def _failure_text(value) -> str:
    """A member's [message, traceback] as the error text: its traceback, else its message."""
    if type(value) is list and len(value) == 2 and all(type(part) is str for part in value):
        return value[1] or value[0]
    return str(value)[:400]


def _member_item(items, j: int, count: int) -> tuple:
    """(ok, value) of member j in a group's render or attr reply [[member, ok, value], ...]."""
    if type(items) is not list or len(items) > count:
        return False, ["the group's reply is malformed", ""]
    for item in items:
        if type(item) is list and len(item) == 3 and item[0] == j and type(item[1]) is bool:
            return item[1], item[2]
    return False, [f"the group's reply has no item for member {j}", ""]
