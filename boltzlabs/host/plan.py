"""The plan: every policy file, read once, checked and compiled into what one pool's sandboxes are made of.

    sandbox/policy.toml + mounts/*.toml + sandbox/seccomp.toml --load_policy()--> Policy (the TOML, as read)
    Policy + env dir + workspace_size + limits + HostAccount --compile_plan()--> Plan (frozen)
        Plan --builder.SandboxSpec--> spawn="exec":     bwrap argv per env (bwrap makes the namespaces)
                                      spawn="template": the template's bwrap argv, with
        Plan.child_text() --$BOLTZLABS_CONFINE--> runtime/confine.parse() --> the template executes it
                                                   for every child; exec mode's confine, its last steps

Runs on the host, in the worker. Every value of the policy that shapes a
sandbox is read here and nowhere else, checked with an error that names its
key and file, and handed on as data: the code inside a sandbox (runtime/)
decides nothing, it executes the plan's child part (which namespaces a
forked env unshares, its mounts and their sizes, its hostname and ids).
"""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

from boltzlabs.errors import SandboxUnavailable
from boltzlabs.runtime import confine
from boltzlabs.host import limits as _limits
from boltzlabs.host import roots as _roots
from boltzlabs.host import seccomp
from boltzlabs.host.identity import HostAccount
from boltzlabs.host.policy import MOUNT_PROFILES, PACKAGE_DIR, Policy, Reader

__all__ = ["Plan", "compile_plan", "NAMESPACES"]

# What [namespaces] unshare may name, and the bwrap flag of each. A mount
# namespace is always made (bwrap does; so does each forked env).
NAMESPACES = {
    "user": "--unshare-user",
    "pid": "--unshare-pid",
    "net": "--unshare-net",
    "ipc": "--unshare-ipc",
    "uts": "--unshare-uts",
    "cgroup": "--unshare-cgroup",
}
# Both spawn modes rest on these two: a user namespace is where the set-up's
# capabilities live (and only there), and an env is pid 1 of its own pid
# namespace, so one kill takes everything it started.
_REQUIRED = ("user", "pid")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,62}[A-Za-z0-9])?")
_MAX_ID = (1 << 32) - 2  # (uid_t)-1 is "no id"


def _below(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@dataclass(frozen=True)
class Plan:
    """Everything a sandbox of this pool is made of, compiled from the policy.

    bwrap-side (exec mode's command line and the template's): `namespaces`,
    `inside_ids`, `hostname`, `die_with_parent`, `new_session`, `cap_drop`,
    `cap_add` (exec) / `template_cap_add`, `ops` (binds, symlinks, /dev and
    /proc, in order), `remount_ro`, `environment`, `executable` and
    `interpreter_flags`. Set-up inside (both modes, `child_text()`): the
    workspace (`workspace`, `workspace_size`, `inodes`), `dev` (/dev/shm and
    the devpts with `ptys`), `proc`, `sysctls`, the rlimits of `limits`.
    Template only: `template_ids`, `hidden_proc`, `warmup_timeout`. And the
    seccomp `filters`, and `default_workspace_size` (RLPool(workspace_size=None)).
    """

    source: str  # the policy file, for error messages
    namespaces: tuple[str, ...]
    inside_ids: tuple[int, int]
    template_ids: tuple[int, int]
    hostname: str
    die_with_parent: bool
    new_session: bool
    cap_drop: tuple[str, ...]
    cap_add: tuple[str, ...]
    template_cap_add: tuple[str, ...]
    env_dir: str
    runtime_dir: str
    workspace: str
    workspace_size: int
    default_workspace_size: int
    inodes: int
    tmp_link: str
    ptys: int
    sysctls: tuple[tuple[str, int], ...]
    dev: str
    proc: str
    hidden_proc: str
    ops: tuple[tuple[str, ...], ...]
    remount_ro: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    executable: str
    interpreter_flags: tuple[str, ...]
    warmup_timeout: float
    limits: dict[str, Any]
    filters: seccomp.Filters
    relocations: tuple[tuple[str, str], ...]
    relocate_tmp: str
    # What the pool's import roots left out of the sandbox (host/roots.py), said once to the
    # trainer at start; "" when every root was bound as it is.
    import_note: str = ""

    def inside(self, path: str) -> str:
        """Where a host path is bound inside the sandbox: the interpreter and
        its site-packages at neutral paths (`relocations`); else the same
        path, except below /tmp, which inside is the env's workspace. A host
        path there is bound below `relocate_tmp` instead."""
        return _inside(path, self.relocations, self.tmp_link, self.relocate_tmp)

    def child_text(self) -> str:
        """The set-up every sandbox makes inside (exec mode's confine, each
        child of the template): $BOLTZLABS_CONFINE's text (runtime/confine.py)."""
        return confine.encode(self._child_items())

    def template_text(self, open_files: int, trusted: bool = False, namespaces: int = 1) -> str:
        """The template's $BOLTZLABS_CONFINE: `child_text()`'s items and its own:
        its rlimits (room for `open_files`), its hidden proc and ids, the
        warm-up imports' seconds, the env's memory limit (the probe's too),
        whether env.py is trusted (RLPool(trust_env=True): imported in the
        template) and how many namespaces of each kind its children may make
        together (its own user namespace's quotas)."""
        return confine.encode(
            {
                **self._child_items(),
                "template_rlimits": _limits.encode(self.limits, open_files),
                "hidden_proc": self.hidden_proc,
                "template_uid": self.template_ids[0],
                "template_gid": self.template_ids[1],
                "warmup": self.warmup_timeout,
                "memory": int(self.limits.get("memory") or 0),
                "trusted": int(bool(trusted)),
                "namespaces": int(namespaces),
            }
        )

    def _child_items(self) -> dict[str, Any]:
        return {
            "unshare": ",".join(ns for ns in self.namespaces if ns not in _REQUIRED),
            "uid": self.inside_ids[0],
            "gid": self.inside_ids[1],
            "hostname": self.hostname,
            "workspace": self.workspace,
            "size": self.workspace_size,
            "inodes": self.inodes,
            "ptys": self.ptys,
            "dev": self.dev,
            "proc": self.proc,
            "rlimits": _limits.encode(self.limits),
            **{f"sysctl.{name}": value for name, value in self.sysctls},
        }


def _inside(path: str, relocations: Any, tmp: str, relocate_tmp: str) -> str:
    for host, inside in relocations:
        if _below(path, host):
            moved: str = inside + path[len(host) :]
            return moved
    if tmp and _below(path, tmp):
        return relocate_tmp + path[len(tmp) :]
    return path


def _with_setfcap(cap_add: tuple[Any, ...], inside_ids: tuple[Any, ...]) -> tuple[Any, ...]:
    """Exec mode's set-up capabilities: [process] cap_add, and CAP_SETFCAP when
    [identity] uid or gid is not 0. The set-up maps them onto uid 0 of
    bubblewrap's namespace (boltzlabs.runtime.confine.Plan.become_ids), which
    the kernel allows only with CAP_SETFCAP there; dropped with the rest
    before any env code."""
    if inside_ids != (0, 0) and "CAP_SETFCAP" not in cap_add:
        return (*cap_add, "CAP_SETFCAP")
    return tuple(cap_add)


def compile_plan(
    policy: Policy,
    source_dir: Any,
    workspace_size: int | None = None,
    limits: dict[str, Any] | None = None,
    account: HostAccount | None = None,
    *,
    env_fns: str | None = None,
    import_roots: Any = (),
    expose: Any = (),
    env_vars: dict[str, Any] | None = None,
    inherited: dict[str, Any] | None = None,
) -> Plan:
    """Check the policy and compile the plan of one pool's sandboxes.

    `source_dir`: the env's directory; `workspace_size`: bytes, None for the
    policy's [workspace] default_size; `limits`: the pool's resolved env
    limits (None: the policy's); `account`: who bwrap runs as on the host
    (None: the current user, nothing staged). `env_fns`: the pool's env_fns
    file (boltzlabs/runtime/env_fns.py), bound read-only; `import_roots`:
    what the trainer imports from outside its site-packages
    (boltzlabs/pool/imports.py: [path, kind, name] each), bound read-only at
    neutral paths, narrowed to their packages and modules (host/roots.py),
    and put on the sandbox's PYTHONPATH; `expose`: host paths below those
    roots bound too, whole (RLPool(expose=)); `env_vars`: the
    pool's own variables (RLPool(env_vars=)); `inherited`: the environment
    the policy's [pass_environment] names are taken from (None: this
    process's). Raises SandboxUnavailable naming the policy key that is
    wrong, and what it must be, and ValueError for a variable or root the
    pool may not have."""
    read = policy.reader()
    namespaces = read.names("namespaces", "unshare")
    unknown = [ns for ns in namespaces if ns not in NAMESPACES]
    missing = [ns for ns in _REQUIRED if ns not in namespaces]
    if unknown or missing or len(set(namespaces)) != len(namespaces):
        raise read.fail(
            "[namespaces] unshare",
            f"a list of distinct names from {sorted(NAMESPACES)} that holds {' and '.join(map(repr, _REQUIRED))}",
            list(namespaces),
        )
    inside_ids = (read.integer("identity", "uid", 0, _MAX_ID), read.integer("identity", "gid", 0, _MAX_ID))
    # Not 0: mapping a parent namespace's id 0 needs CAP_SETFCAP there (policy.toml says why).
    template_ids = (read.integer("template", "uid", 1, _MAX_ID), read.integer("template", "gid", 1, _MAX_ID))
    hostname = read.get("process", "hostname", 'a host name, or "" for none')
    if not isinstance(hostname, str) or (hostname and not _HOSTNAME.fullmatch(hostname)):
        raise read.fail("[process] hostname", "a host name (letters, digits, '.', '-'; at most 64)", hostname)
    if hostname and "uts" not in namespaces:
        raise read.fail(
            "[process] hostname",
            "empty when [namespaces] unshare has no \"uts\" (the host's name is not the sandbox's to change)",
            hostname,
        )
    env_dir, runtime_dir = read.path("process", "env_dir"), read.path("process", "runtime_dir")
    workspace = read.path("workspace", "path")
    default_size = read.size("workspace", "default_size")
    size = default_size if workspace_size is None else int(workspace_size)
    if size <= 0:
        raise ValueError(f"workspace_size must be a positive number of bytes, not {workspace_size!r}")
    bytes_per_inode = read.integer("workspace", "bytes_per_inode", 1)
    tmp_link = read.get("workspace", "tmp_link", 'an absolute path, or "" for none')
    if tmp_link:
        tmp_link = read.path("workspace", "tmp_link")
    ptys = read.integer("quotas", "ptys", 0, 1 << 20)
    quotas = read.table("quotas.user_namespace")
    # Only the limits this kernel has (max_fanotify_* came in 5.13): the
    # host's /proc/sys/user lists the same kernel's.
    sysctls = []
    for name in quotas:
        value = read.integer("quotas.user_namespace", name, 0, (1 << 31) - 1)
        if not re.fullmatch(r"[a-z_]{1,64}", name):
            raise read.fail(f"[quotas.user_namespace] {name}", "a name of /proc/sys/user", name)
        if os.path.exists(f"{confine.SYSCTL_DIR}/{name}"):
            sysctls.append((name, value))
    relocations, site_packages = _relocations(policy.mounts["interpreter"])
    scanner = _roots.Scanner(read.names("import_roots", "hide"), read.integer("import_roots", "scan_limit", 0))
    roots, binds, path_before, path_after, import_note = _import_roots(
        policy.mounts["interpreter"], import_roots, relocations, scanner, expose
    )
    relocations += roots
    relocate_tmp = read.path("workspace", "relocate_tmp")

    def inside(p: str) -> str:
        return _inside(p, relocations, tmp_link, relocate_tmp)

    values = {
        "base_prefix": sys.base_prefix,
        "site_packages": site_packages,
        "source_dir": str(source_dir),
        "env_dir": env_dir,
        "runtime_dir": runtime_dir,
        "package_dir": str(PACKAGE_DIR),
        "workspace": workspace,
        "site_path": ":".join(inside(p) for p in site.getsitepackages() if os.path.isdir(p)),
        "import_roots": binds,
        "python_path": ":".join(path_before),
        "pth_path": ":".join(path_after),
        "env_fns": [env_fns] if env_fns else [],
        "env_fns_file": read.path("process", "env_fns_file"),
    }
    ops = _mount_ops(policy, values, account, inside)
    specials = {op[0][2:]: op[1] for op in ops if op[0] in ("--dev", "--proc")}
    if "dev" not in specials or "proc" not in specials:
        raise SandboxUnavailable(
            f'the mount profiles (mounts/*.toml) need a [[special]] of kind "dev" and one of '
            f'kind "proc" (the set-up inside mounts /dev/shm, devpts and proc there); '
            f"they have {sorted(specials)}; reinstall boltzlabs"
        )
    for op in ops:
        if _below(op[-1], workspace):
            raise read.fail("[workspace] path", f"no parent of a mounted path (it would hide {op[-1]})", workspace)
    remount_ro = read.names("finish", "remount_ro")
    if not all(path.startswith("/") and os.path.normpath(path) == path for path in remount_ro):
        raise read.fail("[finish] remount_ro", "a list of absolute paths", list(remount_ro))
    written = read.table("environment")
    try:
        environment: tuple[tuple[str, Any], ...] = tuple(
            (name, _no_empty_entries(name, str(value).format(**values))) for name, value in written.items()
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise read.fail(
            "[environment]", "strings whose {placeholders} are " + ", ".join(sorted(values)), str(exc)
        ) from None
    if env_fns:
        environment += ((env_fns_variable(), values["env_fns_file"]),)
    environment += _passed(read, dict(environment), env_vars, os.environ if inherited is None else inherited)
    flags = read.names("interpreter", "flags")
    if not all(flag.startswith("-") for flag in flags):
        raise read.fail("[interpreter] flags", "a list of interpreter options, each starting with '-'", list(flags))
    libdir = sysconfig.get_config_var("LIBDIR")
    # A shared libpython is found through the binary's RUNPATH, which names
    # the host prefix: relocated, the loader needs to be told.
    if (
        sysconfig.get_config_var("Py_ENABLE_SHARED")
        and libdir
        and _inside(libdir, relocations, tmp_link, relocate_tmp) != libdir
    ):
        environment += (("LD_LIBRARY_PATH", _inside(libdir, relocations, tmp_link, relocate_tmp)),)
    return Plan(
        source=read.source,
        namespaces=namespaces,
        inside_ids=inside_ids,
        template_ids=template_ids,
        hostname=hostname,
        die_with_parent=read.flag("process", "die_with_parent"),
        new_session=read.flag("process", "new_session"),
        cap_drop=read.names("process", "cap_drop"),
        cap_add=_with_setfcap(read.names("process", "cap_add"), inside_ids),
        template_cap_add=read.names("template", "cap_add"),
        env_dir=env_dir,
        runtime_dir=runtime_dir,
        workspace=workspace,
        workspace_size=size,
        default_workspace_size=default_size,
        inodes=max(64, size // bytes_per_inode),
        tmp_link=tmp_link,
        ptys=ptys,
        sysctls=tuple(sysctls),
        dev=specials["dev"],
        proc=specials["proc"],
        hidden_proc=read.path("template", "hidden_proc"),
        ops=tuple(ops),
        remount_ro=remount_ro,
        environment=environment,
        executable=_inside(os.path.realpath(sys.executable), relocations, tmp_link, relocate_tmp),
        interpreter_flags=flags,
        warmup_timeout=read.number("template", "warmup_timeout"),
        limits=policy.env_limits() if limits is None else limits,
        # sandbox/seccomp.toml, read with the rest by load_policy, compiled here.
        filters=seccomp.compile_rules(policy.seccomp),
        relocations=tuple(relocations),
        relocate_tmp=relocate_tmp,
        import_note=import_note,
    )


def env_fns_variable() -> str:
    """The variable naming the env_fns file inside (boltzlabs.runtime.env_fns.VARIABLE)."""
    from boltzlabs.runtime.env_fns import VARIABLE

    return VARIABLE


def _no_empty_entries(name: str, value: str) -> str:
    # An empty entry of a search path is the current directory (for
    # PYTHONPATH, the workspace, which the env writes): a placeholder with
    # nothing to put there leaves none.
    if name.endswith("PATH") and ":" in value:
        return ":".join(part for part in value.split(":") if part)
    return value


# Never passed into a sandbox, whatever the policy or the pool says: the
# variables the interpreter reads at start-up (PYTHON*: PYTHONPATH and
# PYTHONWARNINGS import modules) and those the dynamic loader and libc act on
# (glibc's own list of what a privileged process must not trust:
# UNSECURE_ENVVARS) run code or change what is loaded before the set-up inside
# has dropped the sandbox's capabilities (boltzlabs/runtime/confine.py). And
# the runtime's own (BOLTZLABS_*).
_NEVER_PASSED = ("PYTHON", "BOLTZLABS_", "LD_")
_NEVER_PASSED_NAMES = frozenset(
    (
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TZDIR",
    )
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def refused_variable(name: str, fixed: Any) -> str | None:
    """Why the variable `name` may not be passed into a sandbox, or None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return "is not a variable name (letters, digits and '_')"
    if name in fixed:
        return "is set by the sandbox policy ([environment] of sandbox/policy.toml), which wins"
    if name.startswith(_NEVER_PASSED) or name in _NEVER_PASSED_NAMES:
        return (
            "is read by the interpreter or the dynamic loader before the sandbox's set-up has dropped its "
            "capabilities: never passed"
        )
    return None


def _passed(read: Reader, fixed: dict[str, Any], env_vars: dict[str, Any] | None, inherited: Any) -> tuple[Any, ...]:
    """The variables an env gets besides the policy's own: those of
    [pass_environment] names that are set in `inherited`, then the pool's
    `env_vars` (ValueError for one that may not be passed)."""
    passed = {}
    for name in read.names("pass_environment", "names"):
        if refused_variable(name, fixed):
            raise read.fail(
                "[pass_environment] names",
                f"variables that may be passed ({name!r} {refused_variable(name, fixed)})",
                name,
            )
        if name in inherited:
            passed[name] = inherited[name]
    if env_vars is not None and not isinstance(env_vars, dict):
        raise TypeError(f"env_vars must be a dict of variable names to strings, not {type(env_vars).__name__}")
    for name, value in (env_vars or {}).items():
        why = refused_variable(name, fixed)
        if why:
            raise ValueError(f"env_vars: {name!r} {why}")
        if not isinstance(value, str) or "\0" in value or len(value) > 65536:
            raise ValueError(f"env_vars[{name!r}] must be a string (no NUL, at most 64 KiB), not {value!r:.80}")
        passed[name] = value
    return tuple(passed.items())


def _import_roots(
    interpreter: dict[str, Any], import_roots: Any, relocations: Any, scanner: _roots.Scanner, expose: Any = ()
) -> tuple[list[Any], list[str], list[Any], list[Any], str]:
    """(host path, inside) relocations for what the trainer imports from outside
    its site-packages (`import_roots`: [path, kind, name] from
    boltzlabs/pool/imports.py), each root at import_dir/<k>; the host paths to
    bind there (each root narrowed to its packages and modules by
    host/roots.py, then `expose`'s paths whole); the PYTHONPATH entries
    inside, those of $PYTHONPATH (kind "path", before site-packages) and those
    of .pth files and editable finders ("pth", "package": after); and the
    note for the trainer of what was left out. A root the sandbox sees already
    (below a site-packages directory, the interpreter or /usr) is not bound
    again: its entry names where it is."""
    roots: list[tuple[str, ...]] = []
    binds: list[str] = []
    before: list[str] = []
    after: list[str] = []
    notes: list[str] = []
    base = interpreter.get("import_dir", "/opt/import")
    seen = set()
    for item in import_roots or ():
        if not (isinstance(item, (list, tuple)) and len(item) == 3 and all(isinstance(x, str) for x in item)):
            raise ValueError(f"import_roots: expected [path, kind, name] items, not {item!r:.200}")
        path, kind, name = item
        if not _clean_path(path) or kind not in ("path", "pth", "package"):
            raise ValueError(f"import_roots: {item!r:.200} is not an absolute path of kind path, pth or package")
        if kind == "package" and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"import_roots: {name!r:.80} is not a module name")
        if path in seen or not os.path.exists(path):
            continue  # gone since the trainer looked: nothing to import from there
        seen.add(path)
        entries = before if kind == "path" else after
        visible = _inside(path, relocations, "", "")
        if visible != path or _below(path, "/usr"):
            entries.append(os.path.dirname(visible) if kind == "package" else visible)
            continue
        where = f"{base}/{len(roots)}"
        if kind == "package":  # an editable finder's package (or module), importable by its name from the entry
            roots.append((path, f"{where}/{name}" + (".py" if os.path.isfile(path) else "")))
        else:
            roots.append((path, where))
        entries.append(where)
        if not os.path.isdir(path):
            binds.append(path)  # a module or a zip archive: what is imported, whole
            continue
        narrowed = scanner.narrow(path, whole_package=kind == "package")
        binds += narrowed.binds
        if narrowed.left_out or narrowed.unscanned:
            notes.append(_narrowed_note(path, kind, narrowed))
    for path in _exposed(expose, [host for host, _ in roots]):
        binds.append(path)
    note = ""
    if notes:
        note = (
            "boltzlabs: envs see only the packages and modules of what this trainer imports from outside its "
            "site-packages, never its other files: "
            + "; ".join(notes)
            + ". To let envs read more of a root (read-only), name the paths in RLPool(expose=[...])."
        )
    return roots, binds, before, after, note


_ROOT_KINDS = {"path": "the $PYTHONPATH entry", "pth": "the .pth entry (an editable install)", "package": "the package"}


def _narrowed_note(path: str, kind: str, narrowed: _roots.Narrowed) -> str:
    def some(names: list[str], most: int) -> str:
        return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")

    text = f"{_ROOT_KINDS[kind]} {path}"
    if kind != "package":
        text += f" shows {some(narrowed.shown, 6) or 'nothing'}"
    if narrowed.left_out:
        text += f"; left out: {some(narrowed.left_out, 8)}"
    if narrowed.unscanned:
        text += f"; bound whole, past the scan's limit ([import_roots] scan_limit): {some(narrowed.unscanned, 4)}"
    return text


def _clean_path(path: Any) -> bool:
    return (
        isinstance(path, str)
        and path.startswith("/")
        and path != "/"
        and os.path.normpath(path) == path
        and not any(c in path for c in ",:\n\0")
    )


def _exposed(expose: Any, roots: list[str]) -> list[str]:
    """RLPool(expose=[...]): host paths below the pool's import roots, bound whole."""
    if expose is None:
        return []
    if not isinstance(expose, (list, tuple)):
        raise TypeError(f"expose must be a list of paths below an import root, not {type(expose).__name__}")
    paths = []
    for path in expose:
        if not _clean_path(path):
            raise ValueError(f"expose: {path!r:.200} is not an absolute path (normalized, no ',' or ':')")
        if not any(_below(path, root) and path != root for root in roots):
            raise ValueError(
                f"expose: {path} is not below an import root of this trainer "
                f"({', '.join(roots) or 'it has none'}): expose binds more of what $PYTHONPATH "
                "or an editable install already names; put other files in the env's directory"
            )
        if os.path.lexists(path):
            paths.append(path)
    return paths


def _relocations(interpreter: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """(host path, inside) pairs for the interpreter and its site-packages
    (mounts/interpreter.toml), and those site-packages."""
    relocations = []
    if not _below(sys.base_prefix, "/usr"):
        relocations.append((sys.base_prefix, interpreter["python_dir"]))
    site_packages: list[str] = []
    for path in site.getsitepackages():
        if (
            os.path.isdir(path)
            and not _below(path, sys.base_prefix)
            and not _below(path, "/usr")
            and os.path.realpath(path) not in map(os.path.realpath, site_packages)
        ):
            relocations.append((path, f"{interpreter['site_dir']}/{len(site_packages)}"))
            site_packages.append(path)
    return relocations, site_packages


def _expand(text: str, values: dict[str, Any]) -> list[str]:
    key = text[1:-1] if text.startswith("{") and text.endswith("}") else None
    if key is not None and isinstance(values.get(key), list):
        return list(values[key])
    return [text.format(**values)]


def _mount_ops(
    policy: Policy, values: dict[str, Any], account: HostAccount | None, inside: Any
) -> list[tuple[Any, ...]]:
    """(flag, [source,] dest) operations from the mount profiles, in order."""
    ops: list[tuple[Any, ...]] = []
    seen: set[str] = set()
    for profile in MOUNT_PROFILES:
        for entry in policy.mounts[profile].get("mount", []):
            for source in _expand(entry["source"], values):
                dest = _expand(entry["dest"], values)[0] if "dest" in entry else inside(source)
                if dest in seen:
                    continue
                if not os.path.lexists(source):
                    if entry.get("optional"):
                        continue
                    raise SandboxUnavailable(f"mount profile {profile!r} needs {source}, which does not exist")
                seen.add(dest)
                if os.path.islink(source):
                    ops.append(("--symlink", os.readlink(source), dest))
                else:
                    flag = "--ro-bind" if entry.get("mode", "ro") == "ro" else "--bind"
                    ops.append((flag, account.source(source) if account else source, dest))
        for special in policy.mounts[profile].get("special", []):
            ops.append((f"--{special['kind']}", special["dest"]))
    return ops
