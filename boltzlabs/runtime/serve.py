"""The env side: `serve(reset=, step=)`, run inside every sandbox.

    worker --STEP/RESET/GO/RENDER/ATTR frames--> [fds $BOLTZLABS_FD] serve() --> your reset/step/...
    worker <--STEPPED/RESET_DONE/RENDERED/ATTR_DONE/FAILED frames-- serve()

The worker starts the sandbox with the channel on its own file descriptors
(two pipes, written on 3 and read on 4, or one socket on 3) and
stdout/stderr on a separate log pipe, so `print`, `sys.stdout.write` and
`os.write(1, ...)` (at import, in reset or in step) land in the env's log and
can never corrupt the channel. Frames are written with `os.write`, unbuffered.
An exception in reset or step is reported with its traceback and the env
keeps serving.

Imports only the standard library and msgpack: every env pays for what this
module imports.
"""

from __future__ import annotations

import os
import sys

from boltzlabs.errors import MemberServed, ProtocolError
from boltzlabs import abi, wire

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["serve", "serve_each", "params", "reset_caller"]

# A trusted template's fork server (runtime/template.py sets it before it
# imports env.py); None everywhere else, forked envs included.
_fork_server: Any = None
# A forked env's channel ((3,) or (4, 3)), set by its template before env.py
# runs; None in exec mode, where $BOLTZLABS_FD says it.
channel: tuple[int, ...] | None = None
started = False  # serve() has been called in this process
# In a group's sandbox (runtime/group.py), the list serve() appends each
# member's callables to instead of serving; None everywhere else.
members: list[Any] | None = None


def params() -> dict[str, Any]:
    """The construction params given to the pool: `RLPool(source, n, params={...})`,
    and its keywords that are no option of the pool (`RLPool(source, n, level=3)`).

    They arrive as JSON in the environment, so values are JSON types (a tuple
    given to the pool arrives as a list).
    """
    import json  # here, not at the top: an env that takes no params does not pay for it

    params: dict[str, Any] = json.loads(os.environ.get(abi.PARAMS_VARIABLE) or "{}")
    return params


def _channel_fds(value: str | None) -> tuple[int, ...]:
    """$BOLTZLABS_FD, set by the worker: "3" (a socket) or "4,3" (the pipe it
    reads, the pipe it writes). Checked, since a wrong fd would fail obscurely later
    (a missing one too: not started by a worker)."""
    value = value or ""
    parts = value.split(",") if len(value) <= 16 else []
    if (
        len(parts) in (1, 2)
        and all(p.isascii() and p.isdigit() and 3 <= int(p) < 1024 for p in parts)
        and len(set(map(int, parts))) == len(parts)
    ):
        return tuple(map(int, parts))
    raise RuntimeError(
        f"{abi.FD_VARIABLE}={value[:40]!r}: expected the channel's fd ('3') or its read and write "
        "pipes' fds ('4,3'), as the boltzlabs worker sets it; start this env with RLPool"
    )


class _Channel:
    """Blocking frame I/O on the env's end of its channel: `rfd` the fd it
    reads, `wfd` the fd it writes (the same socket, or two pipes). `slot`:
    its observation slot (_Slot), None without one, _UNOPENED until the
    first reply that could use it."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        # The pool's max_str_len (abi.MAX_STR_VARIABLE): the longest str a request may hold (an
        # action, reset options, call arguments: the trainer refuses longer actions before sending)
        # and a reply of ours (_reply fails it instead of sending what the worker would refuse).
        self.max_str = _max_str(os.environ.get(abi.MAX_STR_VARIABLE))
        # The worker is trusted more than an env, but a cap still costs nothing.
        self.reader = wire.FrameReader(wire.Limits(1 << 30, max_str_len=self.max_str))
        self.inbox: list[Any] = []
        self.wait = _readable_waiter(rfd)
        self.slot: Any = None
        self.space: Any = None  # the declared observation space's spec, for the slot
        self.eager = Eager() if os.environ.get(abi.EAGER_RESET_VARIABLE) == "1" else None

    def write(self, data: bytes) -> None:
        # Hot path: a reply goes out in one write; a short one (a big
        # observation over a full pipe or socket buffer) loops on what is left.
        sent = os.write(self.wfd, data)
        if sent != len(data):
            view = memoryview(data)[sent:]
            while view:
                view = view[os.write(self.wfd, view) :]

    def receive(self) -> Any:
        inbox = self.inbox
        while not inbox:
            if self.wait is not None:
                self.wait()
            data = os.read(self.rfd, 1 << 16)  # small: a 1 MiB read buffer costs every env heap pages
            if not data:
                raise EOFError
            try:
                inbox += self.reader.feed(data)
            except ProtocolError as exc:
                refuse_request(exc)
        return inbox.pop(0)


def refuse_request(exc: BaseException) -> NoReturn:
    """End this env for a request it cannot decode (its stream is lost, frame boundaries with it):
    why, in its log, and exit abi.REFUSED_EXIT, which the worker names on the lane. Never returns."""
    sys.stderr.write(f"boltzlabs: this env refused a request from the worker: {exc}\n")
    sys.stderr.flush()
    os._exit(abi.REFUSED_EXIT)


def _max_str(value: str | None) -> int:
    """$BOLTZLABS_MAX_STR_LEN as the worker sets it (bytes), or 1 GiB (the frame cap) when unset."""
    if value and value.isascii() and value.isdigit() and 0 < int(value) <= 1 << 30:
        return int(value)
    return 1 << 30


# The most UTF-8 bytes an exception's message and its traceback keep each in a FAILED reply (and
# never over the pool's max_str_len): a test runner's exception may carry megabytes of log.
FAILURE_TEXT = 1 << 16


def _clip(text: str, limit: int) -> str:
    """`text`, or its head and tail with what was cut between them, within `limit` UTF-8 bytes."""
    if len(text) <= limit >> 2 or len(text.encode("utf-8", "surrogatepass")) <= limit:
        return text
    keep = max(0, limit - 96) >> 3  # characters on each side: 4 bytes at most each
    return f"{text[:keep]}\n[... {len(text) - 2 * keep:,} characters cut: over {limit:,} bytes ...]\n{text[-keep:]}"


_UNOPENED = object()


class _Slot:
    """This env's observation slot (wire.py, "observations in shared memory"):
    the memfd on abi.SLOT_FD, which the worker made, sized from the declared
    space and sealed before this env's first request; mapped once and its fd
    closed. An obs of exactly the declared shapes and dtypes is written there
    and the reply carries a SLOT_EXT marker instead; any other obs goes by the
    wire as before."""

    def __init__(self, mapping: Any, layout: wire.SlotLayout) -> None:
        self.mapping, self.layout = mapping, layout
        self.views: list[tuple[Any, ...]] | None = (
            None  # per leaf: (path, dtype, shape, the slot's array), made with the first array obs
        )
        wire.SLOT_HEADER.pack_into(mapping, 0, wire.SLOT_MAGIC, 1, 0, layout.size - wire.SLOT_HEADER_SIZE)

    @classmethod
    def open(cls, space: Any) -> _Slot | None:
        """The slot on abi.SLOT_FD, if there is one of exactly this space's layout, sealed; else None."""
        layout = wire.slot_layout(space, 1 << 30) if space is not None else None
        if layout is None:
            return None
        import fcntl
        import mmap

        try:
            size = os.fstat(abi.SLOT_FD).st_size
            seals = fcntl.fcntl(abi.SLOT_FD, fcntl.F_GET_SEALS)
        except OSError:  # no slot (a remote pool, BOLTZLABS_NO_SHM), or not a memfd
            return None
        need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if size != layout.size or seals & need != need:
            return None  # the space allows no slot for this pool (the worker left it unsized)
        try:
            mapping = mmap.mmap(abi.SLOT_FD, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            return None
        os.close(abi.SLOT_FD)  # the mapping is all this env keeps of it
        return cls(mapping, layout)

    def put(self, obs: Any, seq: int) -> Any:
        """The marker for reply `seq` once obs is in the slot, or obs itself (then it goes by the wire)."""
        views = self.views
        if views is None:
            np = sys.modules.get("numpy")
            if np is None:
                return obs  # an env without NumPy sends no array
            views = self.views = [
                (
                    path,
                    np.dtype(dtype),
                    shape,
                    np.frombuffer(self.mapping, np.dtype(dtype), _count(shape), offset).reshape(shape),
                )
                for path, dtype, shape, offset in self.layout.leaves
            ]
        leaves = []
        for path, dtype, shape, view in views:
            value = _leaf(obs, path, self.layout.spec)
            if value is None or value.shape != shape or value.dtype != dtype:
                return obs
            leaves.append((view, value))
        if self.layout.spec["type"] != "Box" and not _same_keys(obs, self.layout.spec):
            return obs
        for view, value in leaves:
            view[...] = value
        # The data first, then the seq that vouches for it (x86: stores stay in order).
        wire.SLOT_SEQ.pack_into(self.mapping, 8, seq)
        return _marker(seq)


def _count(shape: Any) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _leaf(obs: Any, path: Any, spec: Any) -> Any:
    """The array at `path` in obs, if obs follows the spec's containers there (exact types)."""
    for step in path:
        kind = spec["type"]
        if kind == "Dict":
            if type(obs) is not dict or step not in obs:
                return None
            spec = next(sub for key, sub in spec["spaces"] if key == step)
        else:
            if type(obs) is not tuple or len(obs) != len(spec["spaces"]):
                return None
            spec = spec["spaces"][step]
        obs = obs[step]
    return obs if type(obs).__name__ == "ndarray" and type(obs).__module__ == "numpy" else None


def _same_keys(obs: Any, spec: Any) -> bool:
    """Whether obs's dicts hold exactly the spec's keys in the spec's order (the
    trainer rebuilds them in that order), its tuples exactly its items."""
    stack = [(obs, spec)]
    while stack:
        value, node = stack.pop()
        if node["type"] == "Dict":
            if list(value) != [key for key, _ in node["spaces"]]:
                return False
            stack += [(value[key], sub) for key, sub in node["spaces"]]
        elif node["type"] == "Tuple":
            stack += list(zip(value, node["spaces"]))
    return True


def _marker(seq: int) -> Any:
    import msgpack

    return msgpack.ExtType(wire.SLOT_EXT, seq.to_bytes(8, "little"))


def _readable_waiter(fd: int) -> Any:
    """For a socket channel: a call that sleeps until `fd` is readable (poll), else None.

    An env blocked in read() on a stream socket sleeps on the socket's one
    wait queue, and the worker's read of the env's own reply frees its buffer
    and wakes every sleeper there to say the socket is writable (unix_write_space):
    the env woke twice per step, once for nothing. poll() sleeps for POLLIN
    only (the kernel filters wake-ups by event), so each step costs one wake-up
    and one poll call instead (measured: benchmarks/bench_envside.py,
    docs/performance.md). A pipe has a wait queue per direction: no need.
    """
    import stat

    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        return None
    import select  # the template has it already: shared by every forked env

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller.poll


def _failure(seq: Any, phase: str, exc: BaseException, max_str: int = FAILURE_TEXT) -> Any:
    import traceback  # only on failure: 0.9 MiB and ~8 ms an env need not pay

    limit = min(FAILURE_TEXT, max_str)
    text = _clip("".join(traceback.format_exception(exc)), limit)
    return [wire.FAILED, seq, phase, _clip(f"{type(exc).__name__}: {exc}", limit), text]


def _step_reply(seq: Any, result: Any) -> Any:
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise TypeError(
            f"step() returned {type(result).__name__}"
            f"{f' of length {len(result)}' if isinstance(result, tuple) else ''}; expected "
            "(obs, reward, done, info) or (obs, reward, terminated, truncated, info)"
        )
    if len(result) == 4:
        obs, reward, terminated, info = result
        truncated = False
    else:
        obs, reward, terminated, truncated, info = result
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise TypeError(f"step() returned info of type {type(info).__name__}; expected a dict")
    return [wire.STEPPED, seq, obs, float(reward), bool(terminated), bool(truncated), info]


def reset_caller(reset: Any) -> Any:
    """`call(seed, options)` that calls the env's `reset` the way it takes them.

    Gymnasium's `Env.reset` is keyword-only (`reset(*, seed=None, options=None)`);
    serve()'s documented `reset(seed)` may name its parameter anything. So seed
    goes by keyword where the function has a keyword parameter `seed` (or only
    **kwargs), else positionally; options go by keyword whenever the function
    takes them (`{}` included, as SyncVectorEnv passes it), and to a function
    that takes none only when there are some (its TypeError is then the
    lane's failure). Read from the code object once, not per reset, and
    without `inspect` (an import every exec-mode env would pay for)."""
    func, skip = reset, 0
    if getattr(reset, "__self__", None) is not None and hasattr(reset, "__func__"):
        func, skip = reset.__func__, 1  # a bound method: its self is given
    code = getattr(func, "__code__", None)
    if code is None:  # a builtin, a partial, a callable object: serve()'s own contract
        by_keyword, takes_options = False, False
    else:
        count = code.co_argcount
        positional = code.co_varnames[max(skip, code.co_posonlyargcount) : count]
        names = (*positional, *code.co_varnames[count : count + code.co_kwonlyargcount])
        any_keyword = bool(code.co_flags & 0x08)  # CO_VARKEYWORDS
        only_keywords = not code.co_varnames[skip:count] and not code.co_flags & 0x04  # no positional, no *args
        by_keyword = "seed" in names or (any_keyword and only_keywords)
        takes_options = "options" in names or any_keyword
    if by_keyword and takes_options:
        return lambda seed, options: reset(seed=seed, options=options)
    if by_keyword:
        return lambda seed, options: reset(seed=seed, options=options) if options else reset(seed=seed)
    if takes_options:
        return lambda seed, options: reset(seed, options=options)
    return lambda seed, options: reset(seed, options=options) if options else reset(seed)


class Eager:
    """RLPool(eager_reset=True): an env whose step ended its episode is reset, unseeded, as soon as
    that step's reply is sent, while the trainer works and the sandbox would wait; the next reset
    that asks for no seed, no options and no scrub (the pool's autoreset) takes what that reset
    returned or raised. Any other request of that env finds it reset already (docs/groups.md)."""

    def __init__(self) -> None:
        self.ready: dict[int, tuple[bool, Any]] = {}  # member -> (returned, its result or exception)

    def run(self, member: int, reset: Any) -> None:
        try:
            self.ready[member] = (True, reset(None, None))
        except Exception as exc:  # the env's bug: raised again to the reset that takes it
            self.ready[member] = (False, exc)

    def drop(self, member: Any = None) -> None:
        """Forget the eager reset of `member` (None: of every member): it was stepped instead, or a
        call, set or scrub may change what its next reset makes, which is then made anew."""
        if member is None:
            self.ready.clear()
        else:
            self.ready.pop(member, None)

    def take(self, member: int, reset: Any, seed: Any, options: Any) -> Any:
        """What reset(seed, options) of `member` gives: the eager reset's, when there is one and
        the request is the one it stands for, else a call now."""
        done = self.ready.pop(member, None)
        if done is None or seed is not None or options is not None:
            return reset(seed, options)
        if not done[0]:
            raise done[1]
        return done[1]


def scrubbed(reset: Any, what: Any) -> Any:
    """`reset(seed, options)` after a scrub (runtime/scrub.py) of this sandbox; its info says what
    the scrub removed (info["scrubbed"]). `what`: the RESET frame's scrub field, {"ipc": bool}
    (whether the sandbox has an IPC namespace of its own, whose objects go too)."""

    def reset_scrubbed(seed: Any, options: Any) -> Any:
        from boltzlabs.runtime import scrub

        report = scrub.asked(what)
        result = reset(seed, options)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            return result[0], dict(result[1], scrubbed=report)
        return result, {"scrubbed": report}

    return reset_scrubbed


def _reset_reply(seq: Any, result: Any) -> Any:
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        obs, info = result
    else:
        obs, info = result, {}
    return [wire.RESET_DONE, seq, obs, info]


def _render_reply(seq: Any, frame: Any) -> Any:
    return [wire.RENDERED, seq, frame]


def _attr_reply(seq: Any, value: Any) -> Any:
    return [wire.ATTR_DONE, seq, value]


class _Attributes:
    """What `pool.call` / `get_attr` / `set_attr` reach in this env: the
    `methods`, `attributes` and `target` given to serve()."""

    def __init__(self, methods: Any, attributes: Any, target: Any) -> None:
        self.methods = dict(methods or {})
        self.attributes = {}
        for name, access in dict(attributes or {}).items():
            if callable(access):
                access = (access, None)
            if (
                not isinstance(access, tuple)
                or len(access) != 2
                or not callable(access[0])
                or not (access[1] is None or callable(access[1]))
            ):
                raise TypeError(
                    f"serve(attributes={{{name!r}: ...}}) takes a getter, or a (getter, setter) pair "
                    f"of callables (setter None: read-only); got {access!r}"
                )
            self.attributes[name] = access
        for name, method in self.methods.items():
            if not callable(method):
                raise TypeError(f"serve(methods={{{name!r}: ...}}) takes callables; got {type(method).__name__}")
        for name in (*self.methods, *self.attributes):
            if not isinstance(name, str):
                raise TypeError(f"serve(methods=, attributes=) names must be str, not {name!r}")
        self.target = target

    def describe(self) -> dict[str, Any]:
        """For the HELLO: what the client may ask for before it sends anything."""
        return {
            "methods": sorted(self.methods),
            "attributes": {k: v[1] is not None for k, v in self.attributes.items()},
            "target": None if self.target is None else type(self.target).__name__,
        }

    def run(self, op: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if op == "call" and name in self.methods:
            return self.methods[name](*args, **kwargs)
        if name in self.attributes:
            getter, setter = self.attributes[name]
            if op == "set":
                if setter is None:
                    raise AttributeError(
                        f"the env's attribute {name!r} is read-only (serve(attributes=) gave it no setter)"
                    )
                setter(*args)
                return None
            value = getter()
            # call() on an attribute: Gymnasium's VectorEnv.call calls what is callable.
            return value(*args, **kwargs) if op == "call" and callable(value) else value
        if self.target is not None:
            return self._on_target(op, name, args, kwargs)
        if name in self.methods:
            raise AttributeError(f"{name!r} is a method of this env, not an attribute: use call({name!r}, ...)")
        raise AttributeError(
            f"the env has no method or attribute {name!r}; it offers methods "
            f"{sorted(self.methods)} and attributes {sorted(self.attributes)} "
            "(serve(..., methods=, attributes=) in its env.py)"
        )

    def _on_target(self, op: Any, name: Any, args: Any, kwargs: Any) -> Any:
        # Gymnasium's semantics: get_wrapper_attr looks through the wrappers,
        # set_wrapper_attr sets where the name is defined (else on the outermost).
        target = self.target
        if op == "set":
            setter = getattr(target, "set_wrapper_attr", None)
            if setter is not None:
                setter(name, *args)
            else:
                setattr(target, name, *args)
            return None
        try:
            getter = getattr(target, "get_wrapper_attr", None)
            value = getter(name) if getter is not None else getattr(target, name)
        except AttributeError as exc:
            inner = getattr(target, "unwrapped", target)
            names = sorted(n for n in dir(inner) if not n.startswith("_"))
            shown = ", ".join(names[:40]) + (", ..." if len(names) > 40 else "")
            raise AttributeError(f"{exc}; {type(inner).__name__} has: {shown}") from None
        return value(*args, **kwargs) if op == "call" and callable(value) else value


_ATTRIBUTES = _Attributes(None, None, None)  # serve() sets this env's
# The method a Gymnasium source's env offers (runtime/gym_env) naming its wrappers' classes.
WRAPPER_CLASSES = "boltzlabs_wrapper_classes"
_ATTR_PHASES = {"call": "call", "get": "get_attr", "set": "set_attr"}


def _reply(channel: _Channel, seq: Any, phase: str, build: Any, call: Any, *args: Any) -> Any:
    """Answer request `seq` with build(seq, call(*args)), or FAILED with what it raised.
    A step's or reset's obs goes into the env's slot when it has one and the obs fits.
    Returns the reply sent, None when a failure was sent instead."""
    try:
        reply = build(seq, call(*args))
        slot = channel.slot
        if slot is not None and (build is _step_reply or build is _reset_reply):
            if slot is _UNOPENED:
                slot = channel.slot = _Slot.open(channel.space)
            if slot is not None:
                reply[2] = slot.put(reply[2], seq)
        try:
            data = wire.encode(reply)
        except ValueError as exc:
            if "recursion limit" not in str(exc):
                raise
            # msgpack's encoder stops at 1024 levels; say what that means here.
            raise ValueError(
                f"{phase}() returned a value nested deeper than msgpack can encode (1024 levels); "
                f"the worker accepts at most {wire.MAX_DEPTH} (limits.max_depth): flatten it"
            ) from None
        except TypeError as exc:
            raise TypeError(
                f"{phase}() returned a value that cannot cross the wire ({exc}); send msgpack-able "
                "values (dict, list, tuple, str, numbers, bool, None, bytes) or numpy arrays"
            ) from None
        if len(data) > channel.max_str:
            # Only a frame longer than the cap can hold a str over it. The worker would kill this
            # env for sending one; failing the request instead keeps the env.
            too_long = long_reply(reply, channel.max_str, phase)
            if too_long:  # (not raised: its traceback would show this function, not the env's code)
                data = wire.encode(_failure(seq, phase, ValueError(too_long), channel.max_str))
    except Exception as exc:  # the env's bug: report it, keep serving
        data = wire.encode(_failure(seq, phase, exc, channel.max_str))
        reply = None
    channel.write(data)
    return reply


def long_reply(value: Any, cap: int, phase: str) -> str:
    """Why `value` (a reply, or a group member's obs and info) cannot be sent: it holds a str over
    `cap` bytes, the pool's max_str_len (its size, and how the pool raises the cap); '' if not."""
    size = wire.long_str(value, cap)
    if not size:
        return ""
    return (
        f"{phase}() returned a str of {size:,} bytes (UTF-8), over the pool's max_str_len of {cap:,} bytes: "
        "send less (a log's tail, say), or raise the pool's cap, RLPool(..., limits={'max_str_len': ...}), "
        "up to the sandbox policy's [limits] max_str_len"
    )


def serve(
    reset: Any,
    step: Any,
    *,
    observation_space: Any = None,
    action_space: Any = None,
    metadata: Any = None,
    render: Any = None,
    render_mode: Any = None,
    preload: Any = (),
    warmup_actions: Any = None,
    methods: Any = None,
    attributes: Any = None,
    target: Any = None,
) -> None:
    """Serve this env to the boltzlabs worker that started it. Never returns.

    Call it once, at the end of your `env.py`:

        serve(reset=reset, step=step)

    `reset(seed)` returns `obs` or `(obs, info)`; it is called with `options=`
    too when it takes them (Gymnasium's `env.reset`, called `reset(seed=...,
    options=...)`: `serve(reset=env.reset, ...)` works) or when there are
    some (a non-empty dict); see `reset_caller`. `step(action)` returns
    `(obs, reward, done, info)` or `(obs, reward, terminated, truncated, info)`.
    Values must be msgpack-serializable (dict, list, tuple, str, int,
    float, bool, None, bytes, numpy arrays and numeric numpy scalars). They
    arrive as sent: tuples as tuples, numpy scalars with their dtype, arrays
    as read-only views of the frame.

    `observation_space` and `action_space` (Gymnasium spaces), `metadata` (a
    msgpack-able dict) and `render_mode` travel to the pool in the handshake
    (`pool.env_contract`). `render()`, when given, answers `pool.render()`
    with a frame (e.g. an RGB array); without it, frames are None.

    In a pool with spawn="template" (the default) each env is forked from a
    warm template that imported only library modules, and runs this file
    itself once it is confined. Before the first fork the pool learns what
    the env's real work imports: a throwaway sandbox, confined like any
    env, runs this file, `reset(0)` and a few steps (actions from
    `warmup_actions` if given, else sampled from `action_space` seeded with
    0, else none), and the template imports the library modules they
    imported (numpy.random, say), so no env pays for them on its own.
    `RLPool(..., warmup=False)` turns this off; `pool.env_contract["warmup"]`
    reports it. `preload` names library modules the template imports as
    well (e.g. `["scipy.special"]`, one your env imports only sometimes);
    the probe carries the list, so it needs the warm-up; `RLPool(...,
    preload=[...])` or a `boltzlabs.toml` beside env.py does the same
    without it (docs/templates.md). A name that fails to import is reported
    there, and the pool still starts.

    What `pool.call(name, *args, **kwargs)`, `pool.get_attr(name)` and
    `pool.set_attr(name, value)` (and the Gymnasium adapter's call,
    get_attr, set_attr) reach, and nothing else:
      methods={"name": callable}: call(name, ...) returns callable(...).
      attributes={"name": getter} (read-only) or {"name": (getter, setter)}:
        get_attr(name) returns getter(), set_attr(name, v) calls setter(v),
        call(name, ...) calls getter()'s value if it is callable, else
        returns it (Gymnasium's VectorEnv.call).
      target=obj: every other name is looked up on `obj` with Gymnasium's
        get_wrapper_attr / set_wrapper_attr (plain getattr / setattr for an
        object without them); gym sources pass their env.
    Any other name raises AttributeError naming what is offered (the client
    checks the names of `methods` and `attributes`, which travel in the
    handshake, before it sends anything). Arguments and results cross the
    wire like observations, under the same limits, and a call has the step
    deadline.
    """
    global started
    started = True  # for the runner (rlimits.run): this env.py did call serve()
    if members is not None:
        members.append(
            {
                "reset": reset_caller(reset),
                "step": step,
                "render": render,
                "observation_space": observation_space,
                "action_space": action_space,
                "metadata": metadata,
                "render_mode": render_mode,
                "attributes": _Attributes(methods, attributes, target),
            }
        )
        raise MemberServed
    fd = os.environ.pop(abi.FD_VARIABLE, None)
    if fd is None and channel is None:
        raise RuntimeError(
            "serve() talks to a boltzlabs worker and only runs inside a pool; "
            "start this env with boltzlabs.RLPool('path/to/env_dir', n)"
        )
    global _ATTRIBUTES
    _ATTRIBUTES = _Attributes(methods, attributes, target)
    info = {
        "python": sys.version.split()[0],
        "metadata": metadata or {},
        "render_mode": render_mode,
        "attributes": _ATTRIBUTES.describe(),
    }
    if observation_space is not None or action_space is not None:
        from boltzlabs.runtime.spec import graph_restorer, to_spec

        info["observation_space"] = to_spec(observation_space)
        info["action_space"] = to_spec(action_space)
        restore = graph_restorer(action_space)
        if restore is not None:  # a Graph's GraphInstance arrives as a plain tuple: the env gets its own class
            step = _restoring(step, restore)

    fds = channel if channel is not None else _channel_fds(fd)

    reset = reset_caller(reset)

    def run(channel: tuple[Any, ...]) -> None:
        _serve_loop(_Channel(channel[0], channel[-1]), reset, step, render, info)

    if os.environ.pop(abi.PROBE_VARIABLE, None):
        # The template's warm-up probe (a throwaway sandbox): the env's real
        # work once, its imports reported, then exit (runtime/probe.py).
        from boltzlabs.runtime import probe

        probe.finish(_Probe(lambda seed: reset(seed, None), step, action_space, warmup_actions, preload))
    if _fork_server is not None:
        # RLPool(trust_env=True): this process is the template, env.py imported
        # in it; serve() becomes its fork server (runtime/template.py).
        if len(fds) != 1:
            raise RuntimeError(f"{abi.FD_VARIABLE}: a template's control channel is one socket, not {fds}")
        _fork_server(run, fds[0], _Probe(lambda seed: reset(seed, None), step, action_space, warmup_actions, preload))
    run(fds)
    sys.stdout.flush()
    os._exit(0)


def _restoring(step: Any, restore: Any) -> Any:
    def step_restored(action: Any) -> Any:
        return step(restore(action))

    return step_restored


def serve_each(main: Any) -> None:
    """Run `main()`, which builds the env and ends in serve(), in each process
    that serves a lane, and in no other.

    For an env built per lane (boltzlabs/runtime/fn_env: env_fns[i]() in lane
    i). Where env.py itself runs in each env (spawn="exec", or a template's
    child once it is a sandbox, and its warm-up probe), that is now. In a
    trusted template (RLPool(trust_env=True): env.py imported there), each
    child and the probe call `main()` once they are sandboxes: the template
    never builds an env.
    """
    if _fork_server is None:
        main()  # returns only if it never served: the runner says so (rlimits.run)
        return
    fd = os.environ.pop(abi.FD_VARIABLE, None)
    fds = _channel_fds(fd or "")
    if len(fds) != 1:
        raise RuntimeError(f"{abi.FD_VARIABLE}: a template's control channel is one socket, not {fds}")
    _fork_server(None, fds[0], main)


def _warmup(steps: int = 24) -> None:
    """Template mode: run the serve loop with stand-in callables (never the
    env's reset or step) before the template forks, once over each kind of
    channel a child may get: two pipes (the default) and a socketpair (the
    fallback; it also waits in poll before each read).

    CPython 3.11 rewrites a function's bytecode on its first calls
    (quickening, then specialization), and those writes would copy the
    template's pages into every env; done here once for the path the
    children take, they start with the loop's code already settled (~70 KiB
    less per env, measured; a warm-up over the other channel kind only left
    ~100 KiB per env to copy).
    """
    import socket

    frames = [wire.encode([wire.RESET, 0, 0, None])]
    frames += [wire.encode([wire.STEP, seq, 0, False]) for seq in range(1, steps)]
    requests = b"".join(frames)  # ~0.5 KiB each way: within any pipe's or socket's buffer
    for pipes in (True, False):
        # The replies go to a socket nobody reads until it is closed: a HELLO
        # bigger than a pipe (large metadata or spaces) fits its buffer, where
        # it would block the template here for good.
        ours, theirs = socket.socketpair()
        fds: list[int] = []
        try:
            if pipes:
                fds[:] = os.pipe()
                os.write(fds[1], requests)
                os.close(fds.pop())
                channel = _Channel(fds[0], theirs.fileno())
            else:
                ours.sendall(requests)
                ours.shutdown(socket.SHUT_WR)
                channel = _Channel(theirs.fileno(), theirs.fileno())
            # reset as serve() hands it to the loop (reset_caller's): (seed, options).
            _serve_loop(channel, lambda seed, options: 0, lambda action: (0, 0.0, False, {}), None, {"warm_up": True})
        finally:
            for fd in fds:
                os.close(fd)
            ours.close()
            theirs.close()


class _Probe:
    """The env's real work, run once by the template's warm-up in a throwaway
    sandbox (boltzlabs.runtime.probe.finish), the way the serve loop
    runs it: actions decoded from a frame, replies built and encoded.
    `preload`: serve(preload=...), names the probe's report carries."""

    def __init__(
        self, reset: Any, step: Any, action_space: Any, actions: Any, preload: Any = (), steps: int = 8
    ) -> None:
        self.reset, self.step, self.space, self.actions, self.steps = reset, step, action_space, actions, steps
        self.preload = list(preload or ())

    def prepare(self) -> None:
        """The actions, as the worker would deliver them (decoded from a frame)."""
        actions = self.actions
        if actions is None and hasattr(self.space, "sample") and hasattr(self.space, "seed"):
            self.space.seed(0)
            actions = [self.space.sample() for _ in range(self.steps)]
        reader = wire.FrameReader(wire.Limits(1 << 30))
        self.actions = [
            reader.feed(wire.encode([wire.STEP, 0, action, False]))[0][2] for action in list(actions or ())[:64]
        ]

    def run(self, report: dict[str, Any]) -> None:
        """reset(0), then a step per action; a reset after each done. Raises what they raise."""
        wire.encode(_reset_reply(0, self.reset(0)))
        for action in self.actions:
            reply = _step_reply(0, self.step(action))
            wire.encode(reply)
            report["steps"] += 1
            if reply[4] or reply[5]:
                wire.encode(_reset_reply(0, self.reset(None)))


def _serve_loop(channel: _Channel, reset: Any, step: Any, render: Any, info: dict[str, Any]) -> None:
    """Answer the worker's requests until it closes the channel."""
    channel.write(wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, dict(info, pid=os.getpid())]))
    if info.get("observation_space") is not None and not info.get("warm_up"):
        # Opened at the first step or reset: the worker sizes the slot once it has read a HELLO.
        channel.space, channel.slot = info["observation_space"], _UNOPENED
    receive = channel.receive
    STEP = wire.STEP
    try:
        while True:
            message = receive()
            code = message[0]
            if code == STEP:  # the hot path: one per env-step, no closure made
                _, seq, action, gated = message
                if gated:
                    # serialize_measurement: decoded already, now wait for our turn.
                    while receive()[:2] != [wire.GO, seq]:
                        pass
                eager = channel.eager
                if eager is None:
                    _reply(channel, seq, "step", _step_reply, step, action)
                    continue
                eager.drop(0)  # stepped instead: what an eager reset returned is stale
                reply = _reply(channel, seq, "step", _step_reply, step, action)
                if type(reply) is list and len(reply) == 7 and (reply[4] is True or reply[5] is True):
                    eager.run(0, reset)  # its episode ended: reset now, while the trainer works
            elif code == wire.RESET:
                seq, seed, options = message[1:4]
                if len(message) > 4 and message[4]:  # reset(scrub=True): the sandbox scrubbed first
                    if channel.eager is not None:
                        channel.eager.drop()
                    _reply(channel, seq, "reset", _reset_reply, scrubbed(reset, message[4]), seed, options)
                elif channel.eager is not None:
                    _reply(channel, seq, "reset", _reset_reply, channel.eager.take, 0, reset, seed, options)
                else:
                    _reply(channel, seq, "reset", _reset_reply, reset, seed, options)
            elif code == wire.RENDER:
                seq = message[1]
                _reply(channel, seq, "render", _render_reply, render if render is not None else lambda: None)
            elif code == wire.ATTR:
                _, seq, op, name, args, kwargs = message
                if op != "get" and channel.eager is not None:
                    channel.eager.drop()  # a call or set may change what its next reset makes: made then
                _reply(channel, seq, _ATTR_PHASES[op], _attr_reply, _ATTRIBUTES.run, op, name, args, kwargs)
            else:
                raise ProtocolError(f"unexpected message code {code}")
    except EOFError:
        pass  # the worker closed the channel: the pool is done with us
