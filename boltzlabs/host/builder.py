"""The sandbox builder: the compiled plan in, bubblewrap command lines out.

    sandbox/policy.toml + mounts/*.toml + seccomp.toml --load_policy()--> Policy
    Policy + env dir (+ HostAccount) --plan.compile_plan()--> Plan
    Plan --SandboxSpec--> argv for `[setpriv ...] bwrap ... python env.py` (exec mode),
                          and for the template's own bwrap (template mode)

Every value comes from the plan (boltzlabs/host/plan.py); this module only
orders the operations. bubblewrap applies its arguments in order, so binds
come first and the workspace tmpfs is mounted on a path that is no parent of
any bind (a tmpfs on a parent would hide what was bound below it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from boltzlabs import abi
from boltzlabs.runtime import confine, template
from boltzlabs.host.identity import HostAccount
from boltzlabs.host.plan import NAMESPACES, Plan, compile_plan
from boltzlabs.host.policy import Policy, find_bwrap, load_policy

__all__ = ["SandboxSpec", "Policy", "Plan", "load_policy", "find_bwrap"]

# bwrap reads its options from abi.ARGS_FD (`--args`, NUL-separated), past the
# channel's fds, the seccomp programs' and an observation slot's: bwrap closes
# it once read, and nothing of the options shows in /proc/<pid>/cmdline of
# bwrap or of the sandbox's pid 1 (a fork of it): no host bind source, no plan.


class SandboxSpec:
    """The command lines of one pool's sandboxes, from its compiled `plan`.

    `SandboxSpec(policy, source_dir, workspace_size=None, params=None,
    account=None, limits=None, *, env_fns=None, import_roots=(),
    expose=(), env_vars=None, group=None, max_str_len=None, eager_reset=False)` compiles the plan (plan.compile_plan: None takes the
    policy's default workspace size and env limits). The argv is
    built once per pool; per-env parts (the channel fd number, the env
    index) are appended by `argv()`. `account`: who bwrap runs as on the
    host (boltzlabs.host.identity); None builds the command line for the
    current user with no staging (as a description of the policy).
    """

    def __init__(
        self,
        policy: Policy,
        source_dir: str | Path,
        workspace_size: int | None = None,
        params: dict[str, Any] | None = None,
        account: HostAccount | None = None,
        limits: dict[str, Any] | None = None,
        *,
        env_fns: str | None = None,
        import_roots: Any = (),
        expose: Any = (),
        env_vars: dict[str, Any] | None = None,
        group: tuple[int, ...] | None = None,
        max_str_len: int | None = None,
        eager_reset: bool = False,
    ) -> None:
        self.account = account
        # RLPool(source, n, **params), read in the env by boltzlabs.env.params().
        self.params_json = json.dumps(params or {}, sort_keys=True)
        # RLPool(envs_per_sandbox=k): "k,envs,max_frame" for runtime/group.py; every sandbox is a group.
        self.group_text = ",".join(map(str, group)) if group else ""
        # The pool's max_str_len: what each env's decoder and serve() hold a str to (runtime/serve.py).
        self.max_str_text = str(max_str_len) if max_str_len else ""
        self.eager_reset = eager_reset  # RLPool(eager_reset=True): runtime/serve.py's Eager
        self.source_dir = Path(source_dir).resolve()
        if account is not None:
            account.check_readable(str(self.source_dir), "the env directory", 5)
            if (self.source_dir / "env.py").exists():
                account.check_readable(str(self.source_dir / "env.py"), "the env's code", 4)
        # The pool's env_fns file, what the trainer imports from elsewhere, its
        # own variables: mounts and environment, compiled with the rest (plan.compile_plan).
        self.plan = compile_plan(
            policy,
            self.source_dir,
            workspace_size,
            limits,
            account,
            env_fns=env_fns,
            import_roots=import_roots,
            expose=expose,
            env_vars=env_vars,
        )
        self._child_text = self.plan.child_text()
        bwrap = find_bwrap()
        self._head = self._build_head(bwrap, template=False)
        self._template_head = self._build_head(bwrap, template=True)

    def inside(self, path: str) -> str:
        """Where a host path is bound inside the sandbox (Plan.inside)."""
        return self.plan.inside(path)

    @property
    def executable(self) -> str:
        """The interpreter, as seen inside: the installed one a venv's
        bin/python links to (the venv itself is not bound, only its site-packages)."""
        return self.plan.executable

    def _build_head(self, bwrap: str, template: bool) -> list[str]:
        plan = self.plan
        args = [*(self.account.prefix if self.account else ()), bwrap]
        args += [NAMESPACES[ns] for ns in plan.namespaces]
        # Root of its own user namespace, whatever [identity] uid and gid say: the
        # set-up inside needs it; the env then gets those ids in a user namespace
        # of its own (boltzlabs.runtime.confine.Plan.become_ids; a template's
        # children map them when forked).
        args += ["--uid", "0", "--gid", "0"]
        if plan.die_with_parent:
            args.append("--die-with-parent")
        if plan.new_session:
            args.append("--new-session")
        # (No --disable-userns: boltzlabs.runtime.confine sets max_user_namespaces
        # to 0 with the other quotas, in both modes.)
        for cap in plan.cap_drop:
            args += ["--cap-drop", cap]
        for cap in plan.template_cap_add if template else plan.cap_add:
            args += ["--cap-add", cap]
        if plan.hostname:
            args += ["--hostname", plan.hostname]
        # The workspace's mount point; boltzlabs.runtime.confine mounts it (bwrap's
        # --tmpfs has no inode cap). No parent of a bind (it would hide it).
        args += ["--dir", plan.workspace]
        ops = list(plan.ops)
        if template:  # a mount point for the fully visible proc (template.py says why)
            ops.append(("--dir", plan.hidden_proc))
        if plan.tmp_link:  # nothing is ever bound below it (see Plan.inside)
            args += ["--symlink", plan.workspace, plan.tmp_link]
        args += [arg for op in ops for arg in op]
        # /proc is made read-only inside, once the quotas are written
        # (exec: boltzlabs.runtime.confine; template: template.py, each child's own).
        for path in plan.remount_ro:
            args += ["--remount-ro", path]
        # Both modes start under the template's filter, which leaves out what
        # the set-up inside needs (mount, ...); the set-up then loads the
        # env's full filter before any env code (boltzlabs.runtime.confine, template.py).
        args += ["--seccomp", str(abi.FILTER_FD)]
        args += ["--chdir", plan.workspace, "--clearenv"]
        for name, value in plan.environment:
            args += ["--setenv", name, value]
        args += ["--setenv", abi.PARAMS_VARIABLE, self.params_json]
        if self.group_text:
            args += ["--setenv", abi.GROUP_VARIABLE, self.group_text]
        if self.max_str_text:
            args += ["--setenv", abi.MAX_STR_VARIABLE, self.max_str_text]
        if self.eager_reset:
            args += ["--setenv", abi.EAGER_RESET_VARIABLE, "1"]
        return args

    def hand_over(self, argv: list[str]) -> tuple[list[str], dict[int, bytes]]:
        """`argv` with bwrap's options moved into an fd: (the command line to
        run, {fd number: bytes} to hand the process besides `programs()`)."""
        start = len(self.account.prefix) + 1 if self.account else 1
        end = argv.index("--", start)
        options = b"".join(arg.encode() + b"\0" for arg in argv[start:end])
        return argv[:start] + ["--args", str(abi.ARGS_FD)] + argv[end:], {abi.ARGS_FD: options}

    def environment(self) -> dict[str, Any]:
        """The variables an env sees (besides BOLTZLABS_FD, BOLTZLABS_ENV_INDEX and BOLTZLABS_PARAMS):
        the policy's, those it passes from this environment, the pool's env_vars."""
        return dict(self.plan.environment)

    def programs(self) -> dict[int, bytes]:
        """The seccomp programs a sandbox reads, by fd number (both modes):
        bwrap loads the template's filter from FILTER_FD; the set-up inside
        loads the env's full filter from CHILD_FILTER_FD."""
        return {abi.FILTER_FD: self.plan.filters.template, abi.CHILD_FILTER_FD: self.plan.filters.env}

    def template_argv(
        self, channel_fds: tuple[Any, ...], open_files: int = 0, trusted: bool = False, namespaces: int = 1
    ) -> list[str]:
        """The command line of the warm template (spawn="template"). Its plan
        (Plan.template_text) carries each child's set-up and rlimits, the
        template's own rlimits (room for `open_files`: it holds a pipe for
        each child being made), the seconds its warm-up imports may take,
        the env's memory limit (its probe's), whether env.py is trusted
        (imported in the template) and `namespaces`, what its children may
        make of each namespace kind together."""
        plan = self.plan
        return self._template_head + [
            "--setenv",
            abi.FD_VARIABLE,
            ",".join(map(str, channel_fds)),
            "--setenv",
            confine.VARIABLE,
            plan.template_text(open_files, trusted, namespaces),
            "--setenv",
            abi.CHILD_FILTER_VARIABLE,
            str(abi.CHILD_FILTER_FD),
            "--",
            plan.executable,
            *plan.interpreter_flags,
            "-c",
            template.BOOTSTRAP,
            f"{plan.env_dir}/env.py",
        ]

    def argv(self, channel_fds: tuple[Any, ...], env_index: int) -> list[str]:
        """The full command line of one env's sandbox, its channel on
        `channel_fds` (a socket's fd, or the read then the write pipe's:
        $BOLTZLABS_FD, "3" or "4,3"). boltzlabs.runtime.confine sets the env's
        rlimits, finishes the sandbox, then runs env.py."""
        plan = self.plan
        return self._head + [
            "--setenv",
            confine.VARIABLE,
            self._child_text,
            "--setenv",
            abi.CHILD_FILTER_VARIABLE,
            str(abi.CHILD_FILTER_FD),
            "--setenv",
            abi.FD_VARIABLE,
            ",".join(map(str, channel_fds)),
            "--setenv",
            abi.ENV_INDEX_VARIABLE,
            str(env_index),
            "--",
            plan.executable,
            *plan.interpreter_flags,
            "-c",
            confine.BOOTSTRAP,
            f"{plan.env_dir}/env.py",
        ]
