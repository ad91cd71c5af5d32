"""Several envs in one sandbox: `RLPool(source, n, envs_per_sandbox=k)`, the env side.

    worker --[STEP, seq, entries, gated]--> run(): each member's step or reset, in member order
           --[RESET, seq, table, options]-->
    worker <--[STEPPED, seq, obs, 0.0, False, False, {GROUP_KEY: results}]-- one frame for the group
           <--[RESET_DONE, seq, obs, {GROUP_KEY: results}]--

To the worker a group is one env: one lane, one sandbox, one channel, one
slot, one cgroup, the same state machine. What it carries is the group's:
`entries` holds one item per member, `None` (not asked this turn), `[0,
action]` (step) or `[1, seed, options]` (reset), and comes packed (the bin of
`[STEP, entries]`, which the worker passes on undecoded; or `[STEP, rows]`, one
array with a row per member's action, and `[STEP, rows, [member, ...]]` when those
members are reset instead, unseeded, as next-step autoreset asks); a RESET's seed is the same
kind of table, `[[member, seed, options], ...]`. `results` is `[kinds,
rewards, terminated, truncated, infos, errors]`, a list of one item per
member each: kind -1 (not asked), 0 (stepped) or 1 (reset); an error is
`[phase, message, traceback]` when that member raised, and only that member
fails. `infos` comes as columns, `{key: array of one value per member}`,
when every member's info holds numpy scalars under the same keys
(info_columns). obs is the slot marker (each member's obs in its row of the group's
slot, written in place) or a list of one obs per member (None where none).
The trainer's half is boltzlabs/pool/groups.py, which checks all of it: a
group's reply is the env's output, as untrusted as any.

Each member is env.py run once more as a module of its own, with
$BOLTZLABS_ENV_INDEX its own lane (so env_fns[i] and module-level state
work unchanged); serve() then hands its callables here (serve.members)
instead of serving. Members share the process, the workspace, every other
module they import and every limit: a group is one sandbox.

A fresh process (spawned or respawned) resets every member at its first
request, asked or not, and says so in `kinds`: a respawned group never
steps an env that was not reset.

Standard library and msgpack only, as serve.py.
"""

from __future__ import annotations

import os
import sys

from boltzlabs import abi, wire
from boltzlabs.errors import MemberServed, ProtocolError
from boltzlabs.runtime import serve as _serve

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The key of a group's results in the frame's info; the trainer accepts no other.
GROUP_KEY = "boltzlabs.group"
NOT_ASKED, STEPPED, RESET = -1, 0, 1


def parse(value: str) -> tuple[int, int, int]:
    """$BOLTZLABS_GROUP, "k,envs,max_frame": the group size, the worker's count of envs, and
    the most bytes a frame of ours may hold (the worker's limits.max_frame)."""
    parts = value.split(",") if len(value) <= 48 else []
    if len(parts) == 3 and all(p.isascii() and p.isdigit() for p in parts):
        k, envs, max_frame = map(int, parts)
        if k >= 1 and envs >= 1 and max_frame >= 1:
            return k, envs, max_frame
    raise RuntimeError(
        f"{abi.GROUP_VARIABLE}={value[:48]!r}: expected 'k,envs,max_frame', as the boltzlabs worker sets it"
    )


def run(path: str, code: Any, value: str, main_module: Any) -> None:
    """Build each member of this sandbox's group from env.py (`code`, each run in a module
    main_module(path) makes: rlimits.run's), then serve them. Never returns."""
    k, envs, max_frame = parse(value)
    group = int(os.environ[abi.ENV_INDEX_VARIABLE])
    first = group * k
    count = min(k, envs - first)
    if count < 1:
        raise RuntimeError(f"group {group} of {k} envs each is past the pool's {envs} envs")
    fds = _serve.channel if _serve.channel is not None else _serve._channel_fds(os.environ.pop(abi.FD_VARIABLE, None))
    members: list[Any] = []
    for j in range(count):
        os.environ[abi.ENV_INDEX_VARIABLE] = str(first + j)
        captured: list[Any] = []
        _serve.members = captured
        try:
            exec(code, main_module(path).__dict__)
        except MemberServed:
            pass
        except BaseException:
            # The pool sees the sandbox fail, not which of its envs: say it before the traceback.
            sys.stderr.write(
                f"boltzlabs: env {first + j} (member {j} of this sandbox, envs {first}-{first + count - 1}) "
                f"failed in {path}:\n"
            )
            sys.stderr.flush()
            raise
        if not captured:
            sys.stderr.write(
                f"boltzlabs: {path} returned without calling serve() (env {first + j}, member {j} of its "
                "group): an env.py must end with boltzlabs.env.serve(reset=..., step=...)\n"
            )
            sys.stderr.flush()
            os._exit(abi.NO_SERVE_EXIT)
        members.append(captured[0])
    _serve.members = None
    os.environ[abi.ENV_INDEX_VARIABLE] = str(group)
    channel = _serve._Channel(fds[0], fds[-1])
    Group(members, k, first, max_frame, channel.max_str).serve(channel)
    sys.stdout.flush()
    os._exit(0)


def batched_spec(spec: Any, k: int) -> Any:
    """The spec of k rows of `spec` for the group's slot (Box, and Dict and Tuple of them), else None."""
    if type(spec) is not dict:
        return None
    kind = spec.get("type")
    if kind == "Box":
        return dict(spec, shape=[k, *spec["shape"]], low=_rows(spec["low"], k), high=_rows(spec["high"], k))
    if kind in ("Dict", "Tuple"):
        if kind == "Dict":
            items = [[key, batched_spec(sub, k)] for key, sub in spec["spaces"]]
            subs = [sub for _, sub in items]
        else:
            items = [batched_spec(sub, k) for sub in spec["spaces"]]
            subs = items
        if any(sub is None for sub in subs):
            return None
        return dict(spec, spaces=items)
    return None


def info_columns(infos: list[Any]) -> Any:
    """The members' infos as columns, {key: array of one value per member}, when every member
    answered with an info of the same str keys in the same order, each key's values numpy
    scalars of one numeric type (MuJoCo's, Box2D's infos): one array per key on the wire, not k
    scalars, each of which the worker checks and the trainer decodes in a Python hook (measured:
    the trainer's decode of a step of 32 HalfCheetahs in groups of 16, 180 us against 27). Else
    None: the list goes as it is."""
    first = infos[0] if infos else None
    np = sys.modules.get("numpy")
    if type(first) is not dict or not first or np is None:
        return None
    keys = list(first)
    if any(type(info) is not dict or list(info) != keys for info in infos):
        return None  # a member not asked or failed (None), or another shape of info
    columns = {}
    for key in keys:
        if type(key) is not str or len(key) > _MAX_COLUMN_KEY:
            return None
        values = [info[key] for info in infos]
        kind = type(values[0])
        if not issubclass(kind, np.generic) or set(map(type, values)) != {kind}:
            return None
        dtype = values[0].dtype
        if (dtype.kind, dtype.itemsize) not in wire._NUMERIC:
            return None
        columns[key] = np.array(values, dtype)
    return columns


# A longer key sends the infos as a list, where a key over the pool's max_str_len fails its member alone.
_MAX_COLUMN_KEY = 256


def _rows(bound: Any, k: int) -> Any:
    return bound if not isinstance(bound, list) else [bound] * k


class Group:
    """The members of one sandbox and their serve loop."""

    def __init__(
        self, members: list[Any], k: int, first: int, max_frame: int = 1 << 24, max_str: int = 1 << 30
    ) -> None:
        self.members = members
        self.max_frame = max_frame  # a bigger frame would be the worker's protocol violation: never sent
        # The pool's max_str_len (serve._Channel's): no member's reply holds a longer str (that
        # member fails alone), and the packed entries of a STEP are decoded under it, as a frame is.
        self.max_str = max_str
        self.from_worker = wire.Limits(1 << 30, max_str_len=max_str)
        self.k, self.first = k, first
        self.fresh = True  # no request yet: the first resets every member
        lead = members[0]
        from boltzlabs.runtime.spec import to_spec

        self.member_obs = to_spec(lead["observation_space"]) if lead["observation_space"] is not None else None
        self.member_act = to_spec(lead["action_space"]) if lead["action_space"] is not None else None
        self.slot: Any = None
        self.views: Any = None
        self.ended: list[int] = []  # the members whose episode the last turn ended (eager_reset)
        self.eager: Any = None  # RLPool(eager_reset=True): the channel's _serve.Eager

    def hello(self) -> dict[str, Any]:
        lead = self.members[0]
        info = {
            "python": sys.version.split()[0],
            "metadata": lead["metadata"] or {},
            "render_mode": lead["render_mode"],
            "attributes": lead["attributes"].describe(),
            "group": {
                "size": self.k,
                "members": len(self.members),
                "first": self.first,
                "observation_space": self.member_obs,
                "action_space": self.member_act,
            },
            "pid": os.getpid(),
        }
        # The slot's layout: k rows of the member's space (the last group pads). No action space:
        # the group's action is its members' entries, checked by the trainer per member.
        rows = batched_spec(self.member_obs, self.k)
        if rows is not None:
            info["observation_space"] = rows
        return info

    def serve(self, channel: Any) -> None:
        self.eager = channel.eager
        info = self.hello()
        channel.write(wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, info]))
        if info.get("observation_space") is not None:
            self.slot = _serve._UNOPENED
            channel.space = info["observation_space"]
        receive = channel.receive
        try:
            while True:
                message = receive()
                code = message[0]
                if code == wire.STEP:  # the hot path: one frame per group per turn
                    _, seq, entries, gated = message
                    if gated:
                        while receive()[:2] != [wire.GO, seq]:
                            pass
                    channel.write(self.turn(channel, seq, entries, wire.STEPPED))
                    if self.eager is not None:  # RLPool(eager_reset=True): reset now, while the trainer works
                        for j in self.ended:
                            self.eager.run(j, self.members[j]["reset"])
                elif code == wire.RESET:
                    seq, table, options = message[1:4]
                    entries = self.reset_entries(table, options)
                    scrubbed = None
                    if len(message) > 4 and message[4]:
                        # reset(scrub=True): the sandbox is every member's, so every member resets.
                        entries = [e if e is not None else [RESET, None, None] for e in entries]
                        scrubbed = self.scrub(message[4])
                    channel.write(self.turn(channel, seq, entries, wire.RESET_DONE, scrubbed))
                elif code == wire.RENDER:
                    channel.write(self.render(message[1]))
                elif code == wire.ATTR:
                    _, seq, op, name, args, kwargs = message
                    channel.write(self.attr(seq, op, name, args, kwargs))
                else:
                    raise ProtocolError(f"unexpected message code {code}")
        except EOFError:
            pass

    def scrub(self, what: Any) -> Any:
        """The sandbox scrubbed (runtime/scrub.py): what it removed, or the exception it raised."""
        from boltzlabs.runtime import scrub

        try:
            return scrub.asked(what)
        except Exception as exc:
            return exc

    def reset_entries(self, table: Any, options: Any) -> list[Any]:
        """A RESET's entries: its table [[member, seed, options], ...]; a plain seed resets every member."""
        count = len(self.members)
        if type(table) is not list:  # a plain reset (int or None): every member, env i seed + i
            return [[RESET, None if table is None else table + j, options] for j in range(count)]
        entries: list[Any] = [None] * count
        for item in table:
            if type(item) is not list or len(item) != 3 or type(item[0]) is not int or not 0 <= item[0] < count:
                raise ProtocolError(f"malformed group reset table item {item!r:.80}")
            entries[item[0]] = [RESET, item[1], item[2]]
        return entries

    def turn(self, channel: Any, seq: Any, entries: Any, code: int, scrubbed: Any = None) -> bytes:
        """Run each asked member (a fresh group: every member, reset first) and frame the group's reply.
        `scrubbed`: a scrub's report, which each member's reset info carries, or the exception that
        stopped it, with which every member fails."""
        members = self.members
        count = len(members)
        if type(entries) is bytes:  # the trainer packed them (pool/groups.py); the worker passed them on
            try:
                message = wire.decode(entries, self.from_worker)
            except ProtocolError as exc:
                _serve.refuse_request(exc)
            entries = message[1] if len(message) in (2, 3) and message[0] == wire.STEP else None
            if getattr(entries, "ndim", 0) >= 1 and entries.shape[0] == count:
                # Every member steps, its action a row of one array (pool/groups.py's _packed_rows):
                # each gets its row, a read-only array of its own shape and dtype (of a 1-D array,
                # the numpy scalar of its dtype), as one by one. The members listed third are
                # reset instead, unseeded (next-step autoreset), their row unused.
                entries = [[STEPPED, row] for row in entries]
                for j in _listed(message[2] if len(message) == 3 else [], count):
                    entries[j] = [RESET, None, None]
            elif len(message) == 3:
                entries = None
        if type(entries) is not list or len(entries) != count:
            raise ProtocolError(
                f"a group of {count} envs got {len(entries) if type(entries) is list else entries!r:.40} entries"
            )
        if self.fresh:
            entries = [e if e is not None and e[0] == RESET else [RESET, None, None] for e in entries]
            self.fresh = False
        kinds = [NOT_ASKED] * count
        rewards = [0.0] * count
        terminated = [False] * count
        truncated = [False] * count
        infos: list[Any] = [None] * count
        errors: list[Any] = [None] * count
        obs: list[Any] = [None] * count
        eager = self.eager
        for j in range(count):
            entry = entries[j]
            if entry is None:
                continue
            member = members[j]
            kind = kinds[j] = entry[0]
            try:
                if kind == STEPPED:
                    if eager is not None:
                        eager.drop(j)  # stepped instead: what an eager reset returned is stale
                    result = member["step"](entry[1])
                    if type(result) is tuple and len(result) == 5 and type(result[4]) is dict:
                        # Gymnasium's 5-tuple, as _step_reply takes it, without the reply list it builds.
                        obs[j], reward, ended, cut, infos[j] = result
                        rewards[j], terminated[j], truncated[j] = float(reward), bool(ended), bool(cut)
                    else:
                        reply = _serve._step_reply(seq, result)
                        obs[j], rewards[j], terminated[j], truncated[j], infos[j] = reply[2:]
                else:
                    if isinstance(scrubbed, Exception):
                        raise scrubbed
                    if scrubbed is not None or eager is None:
                        reply = _serve._reset_reply(seq, member["reset"](entry[1], entry[2]))
                    else:
                        reply = _serve._reset_reply(seq, eager.take(j, member["reset"], entry[1], entry[2]))
                    obs[j], infos[j] = reply[2], reply[3]
                    if scrubbed is not None:
                        infos[j] = dict(infos[j], scrubbed=scrubbed)
            except Exception as exc:  # that member's bug: it alone fails
                errors[j] = _serve._failure(seq, "step" if kind == STEPPED else "reset", exc, self.max_str)[2:]
        results = [kinds, rewards, terminated, truncated, infos, errors]
        if eager is not None:
            if scrubbed is not None:
                eager.drop()
            self.ended = [
                j for j in range(count) if kinds[j] == STEPPED and errors[j] is None and (terminated[j] or truncated[j])
            ]
        marker = self.put(channel, obs, kinds, errors, seq)
        if code == wire.STEPPED:
            frame: list[Any] = [
                wire.STEPPED,
                seq,
                obs if marker is None else marker,
                0.0,
                False,
                False,
                {GROUP_KEY: results},
            ]
        else:
            frame = [wire.RESET_DONE, seq, obs if marker is None else marker, {GROUP_KEY: results}]
        return self.encode(frame, obs, infos, errors, kinds)

    def encode(self, frame: list[Any], obs: list[Any], infos: list[Any], errors: list[Any], kinds: list[Any]) -> bytes:
        results = frame[-1][GROUP_KEY]
        columns = info_columns(infos)
        if columns is not None:
            results[4] = columns
            data = wire.encode(frame)  # numeric arrays under short str keys: always encodable
            if len(data) - wire.HEADER.size <= min(self.max_str, self.max_frame):
                return data
            results[4] = infos  # over a cap: member by member below, each failing alone
        try:
            data = wire.encode(frame)
        except (TypeError, ValueError, OverflowError):
            data = self.encode_each(frame, obs, infos, errors, kinds)
        if len(data) - wire.HEADER.size > self.max_str and self.fail_long(obs, infos, errors, kinds):
            data = wire.encode(frame)
        if len(data) - wire.HEADER.size <= self.max_frame:
            return data
        # The members' values together pass the pool's frame cap (k observations by the wire: a
        # remote pool, or a space without a slot): each asked member fails, saying so; the group lives.
        size = len(data)
        for j, kind in enumerate(kinds):
            if kind != NOT_ASKED:
                errors[j] = [
                    "step" if kind == STEPPED else "reset",
                    f"ValueError: the sandbox's reply for its {len(kinds)} envs is {size:,} bytes, over the pool's "
                    f"limits.max_frame of {self.max_frame:,}: use a smaller envs_per_sandbox (each env's "
                    "observation by the wire costs the whole group's frame), or a local pool with a "
                    "fixed-shape observation space (its slot carries observations)",
                    "",
                ]
                infos[j] = None
                if type(obs) is list:
                    obs[j] = None
        return wire.encode(frame)

    def fail_long(self, obs: list[Any], infos: list[Any], errors: list[Any], kinds: list[Any]) -> bool:
        """Each asked member whose obs or info holds a str over the pool's max_str_len fails, saying
        so (the worker would refuse the whole frame, every member with it); whether any did."""
        failed = False
        for j, kind in enumerate(kinds):
            if kind == NOT_ASKED or errors[j] is not None:
                continue
            phase = "step" if kind == STEPPED else "reset"
            why = _serve.long_reply([obs[j] if type(obs) is list else None, infos[j]], self.max_str, phase)
            if why:
                errors[j], infos[j], failed = [phase, f"ValueError: {why}", ""], None, True
                if type(obs) is list:
                    obs[j] = None
        return failed

    def encode_each(
        self, frame: list[Any], obs: list[Any], infos: list[Any], errors: list[Any], kinds: list[Any]
    ) -> bytes:
        # Some member's value cannot cross the wire: that member fails, the others go.
        for j in range(len(obs)):
            try:
                wire.encode([obs[j] if type(obs) is list else None, infos[j]])
            except (TypeError, ValueError, OverflowError) as exc:
                errors[j] = [
                    "step" if kinds[j] == STEPPED else "reset",
                    f"{type(exc).__name__}: the env returned a value that cannot cross the wire ({exc})",
                    "",
                ]
                if type(obs) is list:
                    obs[j] = None
                infos[j] = None
        return wire.encode(frame)

    def put(self, channel: Any, obs: list[Any], kinds: list[Any], errors: list[Any], seq: int) -> Any:
        """Each new obs in its member's row of the slot, then the marker; None (obs go by the wire)
        when the group has no slot or an obs does not have exactly the member's shapes and dtypes."""
        slot = self.slot
        if slot is None:
            return None
        if slot is _serve._UNOPENED:
            slot = self.slot = _serve._Slot.open(channel.space)
            if slot is None:
                return None
        views = self.views
        if views is None:
            np = sys.modules.get("numpy")
            if np is None:
                return None
            views = self.views = [
                (  # the batched spec's paths are the member's: only each Box gained a row dimension
                    path,
                    np.dtype(dtype),
                    shape,
                    np.frombuffer(slot.mapping, np.dtype(dtype), _serve._count(shape), offset).reshape(shape),
                )
                for path, dtype, shape, offset in slot.layout.leaves
            ]
        spec = self.member_obs
        if spec is None:
            return None
        if spec["type"] == "Box":  # the hot path: one array per member, its row of the one view
            _, dtype, shape, view = views[0]
            ndarray = type(view)
            writes = [(view, j, obs[j]) for j, kind in enumerate(kinds) if kind != NOT_ASKED and errors[j] is None]
            for _, _, value in writes:
                if type(value) is not ndarray or value.shape != shape[1:] or value.dtype != dtype:
                    return None
        else:
            writes = []
            for j, value in enumerate(obs):
                if kinds[j] == NOT_ASKED or errors[j] is not None:
                    continue
                for path, dtype, shape, view in views:
                    leaf = _serve._leaf(value, path, spec)
                    if leaf is None or leaf.shape != shape[1:] or leaf.dtype != dtype:
                        return None
                    writes.append((view, j, leaf))
                if not _serve._same_keys(value, spec):  # its keys and items as the spec's
                    return None
        for view, j, leaf in writes:
            view[j] = leaf
        wire.SLOT_SEQ.pack_into(slot.mapping, 8, seq)
        return _serve._marker(seq)

    def render(self, seq: Any) -> bytes:
        """[RENDERED, seq, [[member, ok, frame or [message, traceback]], ...]], every member's."""
        out = []
        for j, member in enumerate(self.members):
            try:
                out.append([j, True, (member["render"] or _none)()])
            except Exception as exc:
                out.append([j, False, _serve._failure(seq, "render", exc, self.max_str)[3:]])
        return self.frame_each(seq, wire.RENDERED, "render", out)

    def attr(self, seq: Any, op: str, name: Any, args: Any, kwargs: Any) -> bytes:
        """call/get/set on the members asked: args is [[[member, member_args], ...]], each member's
        own args (set: [value]); the reply's value is [[member, ok, value or [message, traceback]], ...]."""
        phase = _serve._ATTR_PHASES.get(op, "call")
        table = args[0] if type(args) is list and len(args) == 1 and type(args[0]) is list else None
        count = len(self.members)
        out = []
        for item in table if table is not None else [None]:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not int or not 0 <= item[0] < count:
                raise ProtocolError(f"malformed group attr table item {item!r:.80}")
            j, member_args = item
            if op != "get" and self.eager is not None:
                self.eager.drop(j)  # a call or set may change what its next reset makes: made then
            try:
                out.append([j, True, self.members[j]["attributes"].run(op, name, member_args, kwargs)])
            except Exception as exc:
                out.append([j, False, _serve._failure(seq, phase, exc, self.max_str)[3:]])
        return self.frame_each(seq, wire.ATTR_DONE, phase, out)

    def frame_each(self, seq: Any, code: int, phase: str, out: list[Any]) -> bytes:
        try:
            return wire.encode([code, seq, out])
        except (TypeError, ValueError, OverflowError) as exc:
            message = f"{type(exc).__name__}: {phase}() returned a value that cannot cross the wire ({exc})"
            return wire.encode(_serve._failure(seq, phase, ValueError(message), self.max_str))


def _listed(members: Any, count: int) -> list[int]:
    """The members a rows STEP resets: distinct ints in range(count), ascending; ProtocolError else."""
    if type(members) is not list or len(members) > count:
        raise ProtocolError(f"a group of {count} envs got {members!r:.40} as the members to reset")
    last = -1
    for j in members:
        if type(j) is not int or not last < j < count:
            raise ProtocolError(f"a group of {count} envs got {members!r:.40} as the members to reset")
        last = j
    return members


def _none() -> None:
    return None
