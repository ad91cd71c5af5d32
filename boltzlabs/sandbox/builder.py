"""The sandbox builder: policy data in, one bubblewrap command line out.

    sandbox/policy.toml + mounts/*.toml --load_policy()--> Policy
    Policy + env dir (+ HostAccount) --SandboxSpec--> argv for `[setpriv ...] bwrap ... python env.py`

The policy files are the reviewable part (what an env may see and do); this
module only expands their placeholders and orders the operations. bubblewrap
applies its arguments in order, so binds come first and the workspace tmpfs is
mounted on a path that is no parent of any bind (a tmpfs on a parent would
hide what was bound below it).
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from pathlib import Path

from boltzlabs.errors import SandboxUnavailable
from boltzlabs.runtime import confine
from boltzlabs.sandbox import limits as _limits
from boltzlabs.sandbox import seccomp
from boltzlabs.sandbox.identity import HostAccount
from boltzlabs.sandbox.policy import MOUNT_PROFILES, PACKAGE_DIR, Policy, find_bwrap, load_policy

__all__ = ["SandboxSpec", "Policy", "load_policy", "find_bwrap"]

_NAMESPACE_FLAGS = {
    "user": "--unshare-user", "pid": "--unshare-pid", "net": "--unshare-net",
    "ipc": "--unshare-ipc", "uts": "--unshare-uts", "cgroup": "--unshare-cgroup",
}


def _below(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


class SandboxSpec:
    """Everything needed to start sandboxes for one env source.

    The argv is built once per pool; per-env parts (the channel fd number,
    the env index) are appended by `argv()`. `account`: who bwrap runs as on
    the host (boltzlabs.sandbox.identity); None builds the command line for the
    current user with no staging (as a description of the policy).
    """

    def __init__(self, policy: Policy, source_dir: Path, workspace_size: int, params: dict | None = None,
                 account: HostAccount | None = None, limits: dict | None = None):
        self.policy = policy
        self.account = account
        self.limits = policy.env_limits() if limits is None else limits
        # RLPool(source, n, **params), read in the env by boltzlabs.env.params().
        self.params_json = json.dumps(params or {}, sort_keys=True)
        self.source_dir = Path(source_dir).resolve()
        if account is not None:
            account.check_readable(str(self.source_dir), "the env directory", 5)
            if (self.source_dir / "env.py").exists():
                account.check_readable(str(self.source_dir / "env.py"), "the env's code", 4)
        process = policy.sandbox["process"]
        workspace = policy.sandbox["workspace"]
        self.workspace = workspace["path"]
        # Host path -> where it is bound inside (inside()): neutral paths for
        # the interpreter and its site-packages (mounts/interpreter.toml).
        interpreter = policy.mounts["interpreter"]
        self.relocations: list[tuple[str, str]] = []
        if not _below(sys.base_prefix, "/usr"):
            self.relocations.append((sys.base_prefix, interpreter["python_dir"]))
        site_packages = []
        for path in site.getsitepackages():
            if os.path.isdir(path) and not _below(path, sys.base_prefix) and not _below(path, "/usr") \
                    and os.path.realpath(path) not in map(os.path.realpath, site_packages):
                self.relocations.append((path, f"{interpreter['site_dir']}/{len(site_packages)}"))
                site_packages.append(path)
        self.values = {
            "base_prefix": sys.base_prefix,
            "site_packages": site_packages,
            "source_dir": str(self.source_dir),
            "env_dir": process["env_dir"],
            "runtime_dir": process["runtime_dir"],
            "package_dir": str(PACKAGE_DIR),
            "workspace": self.workspace,
            "site_path": ":".join(self.inside(p) for p in site.getsitepackages() if os.path.isdir(p)),
        }
        self.workspace_size = workspace_size
        # What boltzlabs.runtime.confine does inside: the workspace with its inode
        # cap, a devpts of the env's own, the per-user-namespace quotas.
        quotas = policy.sandbox["quotas"]
        inodes = max(64, workspace_size // int(workspace["bytes_per_inode"]))
        # Only the limits this kernel has (max_fanotify_* came in 5.13): the
        # host's /proc/sys/user lists the same kernel's.
        sysctls = {name: int(value) for name, value in quotas.get("user_namespace", {}).items()
                   if os.path.exists(f"{confine.SYSCTL_DIR}/{name}")}
        self.confine = confine.encode(self.workspace, workspace_size, inodes, int(quotas["ptys"]), sysctls)
        # sandbox/seccomp.toml, compiled here on the host; the spawners hand
        # the programs over on seccomp.FILTER_FD (and CHILD_FILTER_FD).
        self.filters = seccomp.compile_policy()
        bwrap = find_bwrap()
        self._head = self._build_head(bwrap, workspace_size, template=False)
        self._template_head = self._build_head(bwrap, workspace_size, template=True)

    def inside(self, path: str) -> str:
        """Where a host path is bound inside the sandbox: the interpreter and
        its site-packages at neutral paths (`relocations`); else the same
        path, except below /tmp, which inside is the env's workspace. A host
        path there is bound below `relocate_tmp` instead."""
        for host, inside in self.relocations:
            if _below(path, host):
                return inside + path[len(host):]
        tmp = self.policy.sandbox["workspace"].get("tmp_link")
        if tmp and (path == tmp or path.startswith(tmp + "/")):
            return self.policy.sandbox["workspace"]["relocate_tmp"] + path[len(tmp):]
        return path

    @property
    def executable(self) -> str:
        """The interpreter, as seen inside: the installed one a venv's
        bin/python links to (the venv itself is not bound, only its site-packages)."""
        return self.inside(os.path.realpath(sys.executable))

    def _expand(self, text: str) -> list[str]:
        key = text[1:-1] if text.startswith("{") and text.endswith("}") else None
        if key is not None and isinstance(self.values.get(key), list):
            return list(self.values[key])
        return [text.format(**self.values)]

    def _mount_ops(self) -> list[tuple]:
        """(flag, [source,] dest) operations from the mount profiles, in order."""
        ops, seen = [], set()
        for profile in MOUNT_PROFILES:
            for entry in self.policy.mounts[profile].get("mount", []):
                for source in self._expand(entry["source"]):
                    dest = self._expand(entry["dest"])[0] if "dest" in entry else self.inside(source)
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
                        ops.append((flag, self.account.source(source) if self.account else source, dest))
            for special in self.policy.mounts[profile].get("special", []):
                ops.append((f"--{special['kind']}", special["dest"]))
        return ops

    def _build_head(self, bwrap: str, workspace_size: int, template: bool) -> list[str]:
        sandbox = self.policy.sandbox
        process = sandbox["process"]
        args = [*(self.account.prefix if self.account else ()), bwrap]
        for ns in sandbox["namespaces"]["unshare"]:
            args.append(_NAMESPACE_FLAGS[ns])
        identity = sandbox.get("identity", {})
        if "user" in sandbox["namespaces"]["unshare"] and "uid" in identity:
            args += ["--uid", str(identity["uid"]), "--gid", str(identity["gid"])]
        if process.get("die_with_parent"):
            args.append("--die-with-parent")
        if process.get("new_session"):
            args.append("--new-session")
        # (No --disable-userns: boltzlabs.runtime.confine sets max_user_namespaces
        # to 0 with the other quotas, in both modes.)
        for cap in process.get("cap_drop", []):
            args += ["--cap-drop", cap]
        for cap in (sandbox["template"] if template else process).get("cap_add", []):
            args += ["--cap-add", cap]
        args += ["--hostname", process["hostname"]]
        # The workspace's mount point; boltzlabs.runtime.confine mounts it (bwrap's
        # --tmpfs has no inode cap). No parent of a bind (it would hide it).
        args += ["--dir", self.workspace]
        ops = self._mount_ops()
        if template:  # a mount point for the fully visible proc (template.py says why)
            ops.append(("--dir", sandbox["template"]["hidden_proc"]))
        tmp = sandbox["workspace"].get("tmp_link")
        if tmp:  # nothing is ever bound below it (see inside())
            args += ["--symlink", self.workspace, tmp]
        args += [arg for op in ops for arg in op]
        # /proc is made read-only inside, once the quotas are written
        # (exec: boltzlabs.runtime.confine; template: template.py, each child's own).
        for path in sandbox.get("finish", {}).get("remount_ro", []):
            args += ["--remount-ro", path]
        # Both modes start under the template's filter, which leaves out what
        # the set-up inside needs (mount, ...); the set-up then loads the
        # env's full filter before any env code (boltzlabs.runtime.confine, template.py).
        args += ["--seccomp", str(seccomp.FILTER_FD)]
        args += ["--chdir", self.workspace, "--clearenv"]
        for name, value in self.environment().items():
            args += ["--setenv", name, value]
        args += ["--setenv", "BOLTZLABS_PARAMS", self.params_json]
        return args

    def environment(self) -> dict:
        """The variables an env sees (besides BOLTZLABS_FD, BOLTZLABS_ENV_INDEX and BOLTZLABS_PARAMS)."""
        variables = {name: str(value).format(**self.values)
                     for name, value in self.policy.sandbox["environment"].items()}
        # A shared libpython is found through the binary's RUNPATH, which names
        # the host prefix: relocated, the loader needs to be told.
        libdir = sysconfig.get_config_var("LIBDIR")
        if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and self.inside(libdir) != libdir:
            variables["LD_LIBRARY_PATH"] = self.inside(libdir)
        return variables

    def programs(self) -> dict[int, bytes]:
        """The seccomp programs a sandbox reads, by fd number (both modes):
        bwrap loads the template's filter from FILTER_FD; the set-up inside
        loads the env's full filter from CHILD_FILTER_FD."""
        return {seccomp.FILTER_FD: self.filters.template, seccomp.CHILD_FILTER_FD: self.filters.env}

    def template_argv(self, channel_fd: int, open_files: int = 0, warmup: bool = True) -> list[str]:
        """The command line of the warm template (spawn="template"). Each
        child gets the env's rlimits; the template itself the same, except room
        for `open_files` (it holds a pipe for each child being made). With
        `warmup`, it probes the env's real work before forking, for at most
        [template] warmup_timeout seconds (template.warm_up), held to the
        env's memory limit: "seconds,bytes"."""
        timeout = float(self.policy.sandbox["template"].get("warmup_timeout", 5.0)) if warmup else 0.0
        return self._template_head + [
            "--setenv", "BOLTZLABS_WARMUP", f"{timeout!r},{int(self.limits.get('memory') or 0)}",
            "--setenv", _limits.VARIABLE, _limits.encode(self.limits),
            "--setenv", "BOLTZLABS_TEMPLATE_RLIMITS", _limits.encode(self.limits, open_files),
            "--setenv", "BOLTZLABS_FD", str(channel_fd),
            "--setenv", confine.VARIABLE, self.confine,
            "--setenv", "BOLTZLABS_HOSTNAME", self.policy.sandbox["process"]["hostname"],
            "--setenv", "BOLTZLABS_HIDDEN_PROC", self.policy.sandbox["template"]["hidden_proc"],
            "--setenv", "BOLTZLABS_TEMPLATE_ID", "{uid}:{gid}".format(**self.policy.sandbox["template"]),
            "--setenv", "BOLTZLABS_CHILD_FILTER_FD", str(seccomp.CHILD_FILTER_FD),
            "--", self.executable, *self.policy.sandbox["interpreter"]["flags"],
            "-m", "boltzlabs.runtime.template", f"{self.values['env_dir']}/env.py",
        ]

    def argv(self, channel_fd: int, env_index: int) -> list[str]:
        """The full command line of one env's sandbox. boltzlabs.runtime.confine sets
        the env's rlimits, finishes the sandbox, then runs env.py."""
        env_script = f"{self.values['env_dir']}/env.py"
        return self._head + [
            "--setenv", _limits.VARIABLE, _limits.encode(self.limits),
            "--setenv", confine.VARIABLE, self.confine,
            "--setenv", "BOLTZLABS_CHILD_FILTER_FD", str(seccomp.CHILD_FILTER_FD),
            "--setenv", "BOLTZLABS_FD", str(channel_fd),
            "--setenv", "BOLTZLABS_ENV_INDEX", str(env_index),
            "--", self.executable, *self.policy.sandbox["interpreter"]["flags"], "-c", confine.BOOTSTRAP, env_script,
        ]
