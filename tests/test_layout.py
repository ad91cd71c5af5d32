"""The house rules of the package layout, checked on every import of every module.

Where code runs decides what it may import:

    adapters   gym, cluster, cli/*, __main__, testing,  anything below; nothing below imports them
               pytest_plugin (users' CI), sb3 (Stable-Baselines3)
    remote/    the listener on a worker's host           worker/*, host/*, runtime/*, link, ...; never pool/
    pool/      the trainer: RLPool and its links        link, wire, errors, units, pool/*
    worker/    the worker process on the host           host/*, runtime/*, wire, abi, errors, units, worker/*
    host/      the host's half of a sandbox: policy,    runtime/*, wire, abi, errors, units, host/*
               bwrap argv, seccomp compile, cgroups
    runtime/   inside the sandbox (and the env shim)    stdlib, msgpack, wire, abi, errors, runtime/*
    link       the remote handshake, both ends           wire, errors
    wire       the frame format (and _wire, its C twin)  errors
    abi        the host/sandbox contract (fds, names)    nothing of ours
    errors, units                                       nothing of ours

Every import is read with `ast`, function-level ones included, so a lazy
import crosses a line as visibly as a top-level one. A failure names the
file:line and the edge that broke the rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "boltzlabs"

LEAVES = {"errors", "units", "abi"}
ALLOWED = {  # layer -> the layers it may import
    "errors": {"abi"},  # describe_exit names abi's exit codes
    "units": set(),
    "abi": set(),
    "wire": {"errors", "wire"},
    "link": {"errors", "wire", "link"},
    "runtime": {"errors", "abi", "wire", "runtime"},
    "host": {"errors", "units", "abi", "wire", "runtime", "host"},
    "worker": {"errors", "units", "abi", "wire", "runtime", "host", "worker"},
    "pool": {"errors", "units", "wire", "link", "pool"},
    # Host code beside a worker: it hands connections to workers, and never reaches into the trainer's side.
    "remote": {"errors", "units", "abi", "wire", "link", "runtime", "host", "worker", "remote"},
    "adapter": {
        "errors",
        "units",
        "abi",
        "wire",
        "link",
        "runtime",
        "host",
        "worker",
        "pool",
        "remote",
        "adapter",
        "root",
    },
    "root": {"errors", "pool", "adapter"},  # boltzlabs/__init__.py's lazy names
}
ADAPTERS = {"gym", "sb3", "cluster", "cli", "__main__", "testing", "pytest_plugin"}

# Edges that break a rule and cannot be removed without a change of behaviour:
# (importing module, imported module) -> why it is still there.
EXCEPTIONS = {
    (
        "boltzlabs.cluster",
        "boltzlabs.cli.doctor",
    ): "`boltzlabs doctor --cluster` (cli) fans cli.doctor's checks out to every Ray node through "
    "cluster.doctor: a cycle between two adapters, no layer crossed",
    (
        "boltzlabs.pool.client",
        "boltzlabs.worker.native",
    ): "a local grouped pool's direct step (docs/native-step.md#the-direct-step) runs the worker's C step "
    "(_fastpath) in the trainer, on channels the worker lends it: loaded as the worker loads it "
    "(BOLTZLABS_PURE honoured), and only for a local pool, whose worker runs from this installation",
}


# Extension modules (no .py to read): which names they are, for `from boltzlabs import _wire`.
NATIVE = {"boltzlabs._wire", "boltzlabs.worker._fastpath"}


def module_name(path: Path) -> str:
    """boltzlabs/pool/client.py -> boltzlabs.pool.client; boltzlabs/cli/__init__.py -> boltzlabs.cli."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str | None:
    """The layer a module of ours belongs to; None for a module not of ours."""
    parts = module.split(".")
    if parts[0] != "boltzlabs":
        return None
    if len(parts) == 1:
        return "root"
    top = parts[1]
    if top == "env":  # the public shim `from boltzlabs.env import serve`: runs in the env
        return "runtime"
    if top in ADAPTERS:
        return "adapter"
    if top in ("runtime", "host", "worker", "pool", "remote", "link", "wire", "abi", "errors", "units"):
        return top
    if top == "_wire":  # the wire's C twin (native/wire.c): imported by wire only
        return "wire"
    return "unknown"


def our_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (runtime/gym_env/env.py included)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def lazy_names() -> dict[str, str]:
    """boltzlabs/__init__.py's _LAZY table: a name importable from `boltzlabs` -> the module that defines it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("boltzlabs/__init__.py has no _LAZY table")


def imports(path: Path, name: str, modules: dict, lazy: dict) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, function-level included.

    `from X import y` counts as importing X.y when that is a module of ours,
    as the module behind y when X is the lazy top-level package, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules or full in NATIVE:
                    found.append((node.lineno, full))
                elif base == "boltzlabs" and alias.name in lazy:
                    found.append((node.lineno, lazy[alias.name]))
                else:
                    found.append((node.lineno, base))
    return found


def edges() -> list[tuple[str, int, str, str]]:
    """(importing module, line, imported module, file) for every import in the package."""
    modules, lazy = our_modules(), lazy_names()
    out = []
    for name, path in modules.items():
        for line, target in imports(path, name, modules, lazy):
            out.append((name, line, target, str(path.relative_to(ROOT))))
    return out


def _where(edge) -> str:
    source, line, target, file = edge
    return f"{file}:{line}: {source} imports {target}"


def test_every_module_has_a_layer():
    unknown = [name for name in our_modules() if layer(name) == "unknown"]
    assert not unknown, (
        f"modules outside every layer: {unknown}; put them in runtime/, host/, worker/, pool/ "
        "or an adapter, or add the module to tests/test_layout.py's layers"
    )


def test_no_layer_imports_one_it_may_not():
    broken = []
    for edge in edges():
        source, _, target, _ = edge
        ours = layer(target)
        if ours is None or (source, target) in EXCEPTIONS:
            continue
        if ours not in ALLOWED[layer(source)]:
            broken.append(f"{_where(edge)} ({layer(source)} may import only {sorted(ALLOWED[layer(source)])})")
    assert not broken, "imports that cross the layout's lines:\n" + "\n".join(broken)


def test_runtime_imports_only_the_standard_library_and_msgpack():
    """Every env pays for what runtime/ imports; gym_env/env.py and fn_env/env.py are env code (the env
    directories of gym sources and env_fns) and may import gymnasium (and cloudpickle, to unpickle thunks)."""
    broken = []
    for edge in edges():
        source, _, target, _ = edge
        if layer(source) != "runtime" or layer(target) is not None:
            continue
        top = target.split(".")[0]
        allowed = top in sys.stdlib_module_names or top == "msgpack" or top == "__future__"
        if source in ("boltzlabs.runtime.gym_env.env", "boltzlabs.runtime.fn_env.env") and top in (
            "gymnasium",
            "cloudpickle",
        ):
            allowed = True
        if not allowed:
            broken.append(_where(edge))
    assert not broken, "runtime/ must import only the standard library and msgpack:\n" + "\n".join(broken)


def test_the_exceptions_are_still_needed():
    """An excepted edge that is gone must leave the list, so the list says what is left to do."""
    present = {(source, target) for source, _, target, _ in edges()}
    stale = [edge for edge in EXCEPTIONS if edge not in present]
    assert not stale, f"these exceptions no longer occur; remove them from EXCEPTIONS: {stale}"


def _cycle(graph: dict[str, set]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("granularity", ["package", "module"])
def test_no_import_cycle(granularity):
    """No cycle between packages (boltzlabs.pool, boltzlabs.cluster, ...) nor between modules."""
    group = _package if granularity == "package" else (lambda m: m)
    graph: dict[str, set] = {}
    where = {}
    for edge in edges():
        source, _, target, _ = edge
        if layer(target) is None or (source, target) in EXCEPTIONS or layer(source) == "root":
            continue
        a, b = group(source), group(target)
        if a != b and b != "boltzlabs":
            graph.setdefault(a, set()).add(b)
            where.setdefault((a, b), _where(edge))
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}:\n" + "\n".join(
        where[(a, b)] for a, b in zip(cycle, cycle[1:])
    )


def test_the_env_entry_point_loads_only_the_runtime():
    """`from boltzlabs.env import serve` in a fresh interpreter loads the standard library, msgpack and
    boltzlabs.{env, runtime.*, abi, wire, _wire, errors}: nothing else (numpy, the client, the sandbox builder)."""
    code = (
        "import sys; before = set(sys.modules); from boltzlabs.env import serve; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    ours = {
        "boltzlabs",
        "boltzlabs.env",
        "boltzlabs.abi",
        "boltzlabs.wire",
        "boltzlabs._wire",
        "boltzlabs.errors",
        "boltzlabs.runtime",
    }
    extra = [
        m
        for m in loaded
        if not (
            m in ours
            or m.startswith("boltzlabs.runtime.")
            or m.split(".")[0] in sys.stdlib_module_names
            or m.split(".")[0] == "msgpack"
            or m == "cython_runtime"
            or m.startswith("_cython_")
        )
    ]  # what msgpack's C extension loads
    assert not extra, f"`from boltzlabs.env import serve` loaded {extra}; every env would pay for them"
    assert "boltzlabs.runtime.serve" in loaded


def test_the_rules_catch_a_crossing(tmp_path):
    """The checker itself: a runtime module that imports the pool, and one that imports numpy, are both named."""
    fake = {"boltzlabs.runtime.bad": tmp_path / "bad.py", "boltzlabs.pool.client": tmp_path / "client.py"}
    fake["boltzlabs.runtime.bad"].write_text("def f():\n    from boltzlabs.pool import client\n    import numpy\n")
    found = imports(fake["boltzlabs.runtime.bad"], "boltzlabs.runtime.bad", fake, {})
    assert found == [(2, "boltzlabs.pool.client"), (3, "numpy")]
    assert "pool" not in ALLOWED[layer("boltzlabs.runtime.bad")]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# -- one reader of the policy ---------------------------------------------------------------------

# The policy's raw tables (host/policy.py's Policy): read only through boltzlabs/host/'s Reader
# and the typed accessors on Policy, so every default is in sandbox/policy.toml and every bad or
# missing value is named with its key and file.
RAW_TABLES = {"sandbox", "mounts", "seccomp", "limits"}


def _policyish(node: ast.AST) -> bool:
    """An expression that is (by its name) a Policy: `policy`, `self.policy`, `load_policy()`."""
    if isinstance(node, ast.Call):
        func = node.func
        return getattr(func, "id", getattr(func, "attr", "")) == "load_policy"
    name = getattr(node, "id", None) or getattr(node, "attr", None) or ""
    return "policy" in name.lower()


def policy_table_reads(source: str, filename: str = "<source>") -> list[int]:
    """Lines of `source` that index a policy's raw tables: `policy.sandbox[...]`, `policy.limits.get(...)`,
    `load_policy().mounts`, ... (a whole table handed to host/ as an argument is not indexing)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        table = None
        if isinstance(node, ast.Subscript):
            table = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            table = node.func.value
        elif isinstance(node, ast.Attribute) and node.attr in ("sandbox", "mounts", "limits"):
            table = node  # the raw dict itself: nothing outside host/ needs it
        if isinstance(table, ast.Attribute) and table.attr in RAW_TABLES and _policyish(table.value):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_host_reads_the_policys_tables():
    broken = []
    for name, path in our_modules().items():
        if name.startswith("boltzlabs.host"):
            continue
        for line in policy_table_reads(path.read_text(), str(path)):
            broken.append(f"{path.relative_to(ROOT)}:{line}")
    assert not broken, (
        "modules outside boltzlabs/host/ that index the policy's tables (use a typed accessor "
        "of boltzlabs.host.policy.Policy, e.g. pool_limits(), identity()):\n" + "\n".join(broken)
    )


def test_the_policy_check_catches_a_raw_read():
    source = (
        "def f(policy, self):\n"
        "    a = policy.sandbox['limits']['log_tail']\n"
        "    b = self.policy.limits.get('max_pool_bytes', 1 << 30)\n"
        "    c = load_policy().sandbox.get('identity', {})\n"
        "    d = seccomp.compile_rules(load_policy().seccomp)\n"  # a whole table to host/: allowed
        "    e = policy.pool_limits().log_tail\n"
    )
    assert policy_table_reads(source) == [2, 3, 4]


# -- the worker: composed parts, each with its state declared in one place --------------------------

WORKER = PACKAGE / "worker"
# Each part of the worker, by its module: the classes whose state is declared in their __init__.
PARTS = {
    "server.py": {"Worker"},
    "reactor.py": {"Reactor", "Budget"},
    "lifecycle.py": {"Lifecycle"},
    "stepping.py": {"Stepping"},
    "requests.py": {"Requests"},
    "spawn.py": {"ExecSpawner"},
    "cpu_budget.py": {"CpuMeter"},
}
# What a part is called where another part holds it: none of them is assigned to from outside.
PART_NAMES = {"worker", "reactor", "budget", "lifecycle", "stepping", "requests", "spawner", "context", "meter"}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}


def _self_assigned(function: ast.AST) -> set[str]:
    """Attributes of `self` a function assigns (x = , x: T = , x += , and tuple targets)."""
    names = set()
    for node in ast.walk(function):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def test_the_worker_has_no_mixin_bases():
    worker = _classes(WORKER / "server.py")["Worker"]
    assert not worker.bases, f"Worker's bases: {[ast.unparse(b) for b in worker.bases]}; compose parts instead"
    for module, names in PARTS.items():
        for name in names:
            assert not _classes(WORKER / module)[name].bases, f"worker/{module}: {name} inherits; compose it"


def test_each_part_declares_its_state_in_its_init():
    undeclared = []
    for module, names in PARTS.items():
        classes = _classes(WORKER / module)
        for name in names:
            methods = {node.name: node for node in classes[name].body if isinstance(node, ast.FunctionDef)}
            declared = _self_assigned(methods["__init__"])
            for method, node in methods.items():
                for attr in sorted(_self_assigned(node) - declared):
                    undeclared.append(f"worker/{module}: {name}.{method} assigns self.{attr}, not set in __init__")
    assert not undeclared, "\n".join(undeclared)


def test_no_part_assigns_another_parts_attributes():
    """A part changes another through its methods (lifecycle.begin(op), budget.free(n)), never by
    assigning to its attributes: each part's attributes are assigned only in its own module."""
    broken = []
    for path in sorted(WORKER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for target in targets:
                for leaf in ast.walk(target):
                    if not isinstance(leaf, ast.Attribute):
                        continue
                    owner = leaf.value
                    held = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                    if held in PART_NAMES:
                        broken.append(f"worker/{path.name}:{node.lineno}: {ast.unparse(leaf)} assigned")
    assert not broken, "\n".join(broken)


def test_the_spawners_implement_the_declared_protocol():
    from boltzlabs.worker import spawn

    wanted = [
        name
        for name in ("kind", "spawn", "kill", "batching_kills", "process", "close")
        if name in spawn.Spawner.__dict__ or name in spawn.Spawner.__annotations__
    ]
    assert set(wanted) == {"kind", "spawn", "kill", "batching_kills", "process", "close"}
    for spawner in (spawn.ExecSpawner, spawn.TemplateSpawner):
        missing = [name for name in wanted if not hasattr(spawner, name)]
        assert not missing, f"{spawner.__name__} lacks {missing} of spawn.Spawner"
    tree = ast.parse((WORKER / "spawn.py").read_text())
    reach = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id == "worker")
        or (isinstance(node, ast.Attribute) and node.attr == "worker")
        or (isinstance(node, ast.arg) and node.arg == "worker")
    ]
    assert not reach, f"worker/spawn.py reaches into the worker at lines {reach}: hand it what it needs (SpawnContext)"
