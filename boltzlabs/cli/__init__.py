"""The `boltzlabs` command (also `python -m boltzlabs`).

    boltzlabs check PATH|gym://ID     does one env keep the pool's contract?   (boltzlabs.cli.check)
    boltzlabs bench PATH|gym://ID -n  what a pool costs and delivers, per n    (boltzlabs.cli.bench)
        --envs-per-sandbox 1,4,16     ... per k envs in a sandbox, beside AsyncVectorEnv
    boltzlabs doctor                  can this host run pools?                 (boltzlabs.cli.doctor)
    boltzlabs worker --listen H:P     serve pools to remote clients            (boltzlabs.remote.listener)

Each command is a registration in COMMANDS: a function that adds its
subparser to the `subparsers` object and sets `run` (parsed args -> exit
code). A new command is one more entry there. The work is done by the
modules named above; this one parses arguments and formats what they return.

An adapter, in the trainer's process (and `doctor` on each host it checks):
this package may import anything of boltzlabs; nothing below the adapters
imports it (tests/test_layout.py).

Exit codes: 0 all is well (warnings allowed), 1 a problem was found (a check
failed, an env would not start, a lane failed), 2 the command line was wrong
(bad arguments, a source that is not an env, a missing optional dependency).
"""

from __future__ import annotations

import argparse
import json
import sys

from boltzlabs.errors import UsageError

__all__ = ["main", "build_parser", "COMMANDS", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """\
exit codes:
  0  all is well (warnings allowed)
  1  a problem was found (see the FAIL lines)
  2  usage error: bad arguments, a source that is not an env, a missing optional dependency"""
_LABELS = {"ok": "PASS", "warn": "WARN", "fail": "FAIL"}


# -- argument types ----------------------------------------------------------------------------


def _param(text: str) -> tuple:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a param is NAME=VALUE, not {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value  # not JSON: the string itself


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, not {text!r}")
    return value


def _group_sizes(text: str) -> list:
    """--envs-per-sandbox 1,4,16: whole numbers >= 1, comma-separated."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit() and int(part) >= 1):
            raise argparse.ArgumentTypeError(
                f"must be whole numbers >= 1 separated by commas, such as 1,4,16, not {text!r}"
            )
        values.append(int(part))
    return values


def _actions(text: str) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--actions is not JSON ({exc})") from None
    if not isinstance(value, list) or not value:
        raise argparse.ArgumentTypeError("--actions must be a non-empty JSON list of actions, e.g. '[0, 1, 1]'")
    return value


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="PATH|gym://ID",
        help="an env directory (holding env.py) or a Gymnasium id such as gym://CartPole-v1",
    )
    parser.add_argument(
        "--spawn",
        choices=("template", "exec"),
        default="template",
        help="fork envs from one warm template (default) or start one interpreter per env",
    )
    parser.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a construction param (repeatable); VALUE is read as JSON when it parses, "
        "else as a string: gymnasium.make(id, NAME=VALUE), or boltzlabs.env.params()",
    )


def _subparser(subparsers, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


# -- output ----------------------------------------------------------------------------------


def print_findings(findings, width: int = 10, out=None) -> dict:
    """Print each finding as it comes, as a PASS/WARN/FAIL line (its fix below
    it), names padded to `width`; return the counts by status."""
    out = out or sys.stdout
    counts = {"ok": 0, "warn": 0, "fail": 0}
    indent = " " * (width + 7)
    for finding in findings:
        counts[finding.status] += 1
        first, *rest = str(finding.detail).splitlines() or [""]
        print(f"{_LABELS[finding.status]:<5} {finding.name:<{width}} {first}", file=out)
        for line in rest:
            print(indent + line, file=out)
        if finding.fix:
            print(f"{indent}fix: {finding.fix}", file=out)
        out.flush()
    return counts


def _summary(counts: dict) -> str:
    return f"{counts['ok']} passed, {counts['warn']} warning(s), {counts['fail']} failed"


# -- check -----------------------------------------------------------------------------------


def _register_check(subparsers) -> None:
    parser = _subparser(
        subparsers,
        "check",
        "check that one env keeps the pool's contract",
        """\
Start one env in a real sandbox and check, printing one line per finding:
  start      it completes its handshake (else its start-up output is shown)
  handshake  it declares observation and action spaces
  reset      reset(seed) answers, inside the declared observation space
  steps      K steps answer (actions sampled from its action space, or --actions)
  memory     the env's private memory at birth against after reset and the
             steps (read from /proc on this host), the modules it imported
             after the fork, and a preload list (boltzlabs.toml) when they cost
             more than 1 MiB per env
  exception  a step that raises is reported on its lane (info["error"]), not
             raised, and the env then resets and steps normally; the env is
             made to raise by sending an action outside every action space
  replay     a hard reset with the same seed and actions gives a byte-identical
             episode (obs, rewards, terminated, truncated)""",
    )
    _add_source(parser)
    parser.add_argument(
        "--actions",
        type=_actions,
        metavar="JSON",
        help="the actions to step with, a JSON list cycled over the steps (default: sampled "
        "from the env's action space, else 0)",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=10,
        metavar="K",
        help="steps to take (fewer if the episode ends first; default 10)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the reset seed (default 0)")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="how long the env has to answer each step or reset (default 10)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="start the pool with RLPool(..., warmup=False): no warm-up probe, so the memory "
        "stage shows what the env's first reset and steps cost without it",
    )
    parser.set_defaults(run=_run_check)


def _resolve(args) -> dict:
    """The params of args.param; UsageError when the source is no env."""
    from boltzlabs.pool import sources

    params = dict(args.param)
    try:
        sources.resolve(args.source, params)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    return params


def _run_check(args) -> int:
    from boltzlabs.cli.check import check_env

    params = _resolve(args)
    if args.no_warmup:
        import inspect

        from boltzlabs import RLPool

        if "warmup" not in inspect.signature(RLPool.__init__).parameters:
            raise UsageError("--no-warmup: this boltzlabs has no warm-up probe (RLPool takes no warmup=)")
    print(f"boltzlabs check {args.source} (spawn={args.spawn}, {args.steps} step(s), seed {args.seed})", flush=True)
    findings = check_env(
        args.source,
        actions=args.actions,
        steps=args.steps,
        spawn=args.spawn,
        params=params,
        step_timeout=args.timeout,
        seed=args.seed,
        warmup=False if args.no_warmup else None,
    )
    counts = print_findings(findings)
    print(_summary(counts))
    return EXIT_PROBLEM if counts["fail"] else EXIT_OK


# -- bench -----------------------------------------------------------------------------------


def _register_bench(subparsers) -> None:
    parser = _subparser(
        subparsers,
        "bench",
        "measure a pool's throughput, latency, start-up and memory",
        """\
For each n: start a pool of n envs (start-up time), step it --steps times
(resetting finished envs inside the timed loop) and report env-steps/s, the
mean worker_ms (the step as measured in the worker) against roundtrip_ms (as
measured here), memory per env and envs_per_gb() from the kernel's cgroup
accounting. A progress bar goes to stderr on a terminal, a table to stdout.

With --envs-per-sandbox 1,4,16: for each n, a pool per k (k envs in each
sandbox; 1 is a sandbox per env) and, for a Gymnasium id, AsyncVectorEnv
over the same envs, all open at once and taking --rounds turns; the table
gives env-steps/s, CPU per env-step (this process and the side's processes),
envs/GiB and the ratio to AsyncVectorEnv per k (docs/groups.md).""",
    )
    _add_source(parser)
    parser.add_argument(
        "-n",
        type=_positive_int,
        nargs="+",
        required=True,
        metavar="N",
        dest="ns",
        help="pool sizes to measure, one pool each",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=1000, metavar="S", help="timed batched steps per pool (default 1000)"
    )
    parser.add_argument(
        "--actions",
        type=_actions,
        metavar="JSON",
        help="actions to cycle through, each sent to every env (default: sampled from the env's action space, else 0)",
    )
    parser.add_argument(
        "--envs-per-sandbox",
        type=_group_sizes,
        metavar="K[,K...]",
        help="compare RLPool(envs_per_sandbox=K) for each K (1: a sandbox per env) and AsyncVectorEnv, "
        "taking turns: env-steps/s, CPU per env-step, envs/GiB and the ratio to AsyncVectorEnv",
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        default=5,
        metavar="R",
        help="with --envs-per-sandbox: the timed steps of each side cut into R chunks, the sides "
        "taking turns chunk by chunk; figures are medians over them (default 5)",
    )
    parser.add_argument(
        "--pin-sandboxes",
        action="store_true",
        help="make each pool with RLPool(pin_sandboxes=True): each sandbox on one CPU, in turn; with "
        "--envs-per-sandbox, each k twice, placed by the kernel and pinned, taking turns",
    )
    parser.add_argument(
        "--eager-reset",
        action="store_true",
        help="make each pool with RLPool(eager_reset=True): an ended episode's env resets while the "
        "trainer works; with --envs-per-sandbox, each k once more so (pinned too with --pin-sandboxes)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON only, no table")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw env-steps/s and memory per env against n (needs matplotlib: "
        "pip install -e '.[plot]' in a checkout of boltzlabs)",
    )
    parser.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    if args.envs_per_sandbox is not None:
        return _run_bench_groups(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install -e '.[plot]' in a checkout of boltzlabs)"
            ) from None
    params = _resolve(args)
    from boltzlabs.cli.bench import measure

    results = _bench_each_n(
        args,
        len(args.ns),
        lambda n, bar: [
            measure(
                args.source,
                n,
                args.steps,
                spawn=args.spawn,
                actions=args.actions,
                params=params,
                bar=bar,
                pin_sandboxes=args.pin_sandboxes,
                eager_reset=args.eager_reset,
            )
        ],
    )
    if results is None:
        return EXIT_PROBLEM
    if args.json:
        _print_bench_json(args, results)
    else:
        print(_bench_table(results))
    if args.plot:
        _plot(results, args.plot, f"{args.source} (spawn={args.spawn}, {args.steps} steps)")
        if not args.json:
            print(f"plot: {args.plot}")
    return _bench_failures(results, lambda r: f"n={r['n']}")


def _run_bench_groups(args) -> int:
    """bench --envs-per-sandbox: a pool per k and AsyncVectorEnv beside, per n (cli/bench.py's compare)."""
    if args.plot:
        raise UsageError("--plot draws figures against n: leave it out with --envs-per-sandbox")
    params = _resolve(args)
    from boltzlabs.cli.bench import compare, pool_sides, twin

    with_async = twin(args.source, params, 1) is not None
    sides = sum(
        len(pool_sides(args.envs_per_sandbox, n, args.pin_sandboxes, args.eager_reset)) + with_async for n in args.ns
    )
    results = _bench_each_n(
        args,
        sides,
        lambda n, bar: compare(
            args.source,
            n,
            args.envs_per_sandbox,
            args.steps,
            rounds=args.rounds,
            spawn=args.spawn,
            actions=args.actions,
            params=params,
            bar=bar,
            pin_sandboxes=args.pin_sandboxes,
            eager_reset=args.eager_reset,
        ),
    )
    if results is None:
        return EXIT_PROBLEM
    if args.json:
        _print_bench_json(args, results, rounds=args.rounds, envs_per_sandbox=args.envs_per_sandbox)
    else:
        print(_groups_table(results, args, with_async))
    return _bench_failures(results, lambda r: f"n={r['n']}, k={r['k']}")


def _bench_each_n(args, sides: int, run) -> list | None:
    """`run(n, bar)`'s results for each n of args.ns, under one bar of `sides` x args.steps steps;
    None, said on stderr, when a pool failed."""
    from tqdm import tqdm

    from boltzlabs.errors import BoltzLabsError

    results: list = []
    with tqdm(total=sides * args.steps, unit="step", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for n in args.ns:
            bar.set_description(f"n={n}")
            try:
                results += run(n, bar)
            except (BoltzLabsError, ValueError) as exc:
                bar.close()
                print(f"boltzlabs bench: a pool of {n} envs failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                return None
    return results


def _print_bench_json(args, results: list, **options) -> None:
    """bench --json: the run's options (`options` besides source, spawn and steps), the version, the results."""
    import boltzlabs

    print(
        json.dumps(
            {
                "source": args.source,
                "spawn": args.spawn,
                "steps": args.steps,
                **options,
                "boltzlabs": boltzlabs.__version__,
                "results": results,
            },
            indent=2,
        )
    )


def _bench_failures(results: list, where) -> int:
    """The exit status of a bench: each result whose steps failed said on stderr (`where(r)`: its n, k)."""
    failed = [r for r in results if r["failed_steps"]]
    for r in failed:
        print(
            f"boltzlabs bench: {r['failed_steps']} lane step(s) failed at {where(r)}; the first: {r['first_error']}",
            file=sys.stderr,
        )
    return EXIT_PROBLEM if failed else EXIT_OK


_GROUP_COLUMNS = (
    ("n", "n", "{}"),
    ("k", "k", "{}"),
    ("sandboxes", "sandboxes", "{}"),
    ("env-steps/s", "env_steps_per_s", "{:,.0f}"),
    ("CPU us/env-step", "cpu_us_per_env_step", "{:.1f}"),
    ("envs/GiB", "envs_per_gb", "{:,.0f}"),
    ("/ AsyncVectorEnv", "vs_async", "{:.2f}x"),
)


def _groups_table(results: list, args, with_async: bool) -> str:
    rows = [[label for label, _, _ in _GROUP_COLUMNS]]
    rows += [["-" if r[key] is None else fmt.format(r[key]) for _, key, fmt in _GROUP_COLUMNS] for r in results]
    for row, r in zip(rows[1:], results):
        if r.get("pinned"):
            row[1] += " pinned"
        if r.get("eager"):
            row[1] += " eager"
    lines = _markdown(rows)
    sources = sorted({r["memory_source"] for r in results if r["memory_source"]})
    rounds = max(r["rounds"] for r in results)
    lines.append("")
    lines.append(
        "k: envs per sandbox (async: Gymnasium's AsyncVectorEnv, a process per env); env-steps/s and CPU "
        f"(this process and the side's processes): medians of {rounds} round(s) taken in turns"
    )
    if args.pin_sandboxes:
        lines.append(
            "k pinned: the same pool made with pin_sandboxes=True (each sandbox on one CPU, in turn), "
            "beside the pool whose sandboxes the kernel places"
        )
    if args.eager_reset:
        lines.append(
            "k eager: the same pool made with eager_reset=True (an ended episode's env resets while the "
            "trainer works, docs/groups.md)"
        )
    if not with_async:
        lines.append(f"AsyncVectorEnv: not run ({args.source} is an env directory; a Gymnasium id has one)")
    asked = sorted({k for k in args.envs_per_sandbox if any(k > n for n in args.ns)})
    if asked:
        lines.append(f"k = {', '.join(map(str, asked))}: more than n; a sandbox holds at most n envs")
    lines.append(f"memory: {'; '.join(sources)}")
    return "\n".join(lines)


def _markdown(rows: list) -> list:
    """Rows of cells as a markdown table, right-aligned: the header, its rule, the rest."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.rjust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return lines


_COLUMNS = (
    ("n", "n", "{}"),
    ("start (s)", "start_s", "{:.2f}"),
    ("env-steps/s", "env_steps_per_s", "{:,.0f}"),
    ("worker ms", "worker_ms", "{:.2f}"),
    ("roundtrip ms", "roundtrip_ms", "{:.2f}"),
    ("MiB/env", "mib_per_env", "{:.2f}"),
    ("envs/GiB", "envs_per_gb", "{:,.0f}"),
    ("spawn", "spawn", "{}"),
)


def _bench_table(results: list) -> str:
    rows = [[label for label, _, _ in _COLUMNS]]
    rows += [[fmt.format(r[key]) for _, key, fmt in _COLUMNS] for r in results]
    lines = _markdown(rows)
    sources = sorted({r["memory_source"] for r in results})
    lines.append("")
    lines.append(
        f"worker ms / roundtrip ms: mean per step, measured in the worker / here; memory: {'; '.join(sources)}"
    )
    return "\n".join(lines)


def _plot(results: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ns, [r["env_steps_per_s"] for r in results], marker="o")
    left.set(xlabel="envs (n)", ylabel="env-steps/s", title="throughput")
    right.plot(ns, [r["mib_per_env"] for r in results], marker="o", color="tab:orange")
    right.set(xlabel="envs (n)", ylabel="MiB per env (its share of the template included)", title="memory per env")
    for axes in (left, right):
        axes.set_ylim(bottom=0)
        if len(ns) > 1 and max(ns) / min(ns) >= 10:
            axes.set_xscale("log")
        axes.set_xticks(ns, [str(n) for n in ns])
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- doctor ----------------------------------------------------------------------------------


def _register_doctor(subparsers) -> None:
    parser = _subparser(
        subparsers,
        "doctor",
        "check that this host can run sandboxed pools",
        """\
Check this host: bubblewrap (present, version, setuid or not), user namespaces
(and the sysctls that restrict them), a real sandbox and a one-env pool in
each spawn mode, the cgroup version, the memory, pids and freezer cgroups
(each tried in a trial env cgroup), the open-file limit for a pool of -n envs,
and Python and package versions.
Each problem comes with the exact command that fixes it.""",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    parser.add_argument(
        "-n",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="the pool size to plan the fd limit for (default 1000)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="seconds each trial sandbox and pool may take to start and answer (default 60; "
        "more on a slow or emulated host)",
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run the checks on every node of this Ray cluster ('auto' for the running one) "
        "instead of here (needs boltzlabs[ray])",
    )
    parser.set_defaults(run=_run_doctor)


def _run_doctor(args) -> int:
    from boltzlabs.cli.doctor import Finding, run_checks

    if args.ray:
        from boltzlabs.cluster import doctor

        nodes = [(report["node"], [Finding(**f) for f in report["findings"]]) for report in doctor(args.ray, args.n)]
    else:
        nodes = [(None, run_checks(args.n, args.timeout))]
    failed = any(f.status == "fail" for _, findings in nodes for f in findings)
    if args.json:
        if args.ray:
            body = {"nodes": [{"node": node, "findings": [f.to_dict() for f in findings]} for node, findings in nodes]}
        else:
            body = {"findings": [f.to_dict() for f in nodes[0][1]]}
        print(json.dumps({"ok": not failed, **body}, indent=2))
        return EXIT_PROBLEM if failed else EXIT_OK
    for node, findings in nodes:
        if node is not None:
            print(f"\n== node {node}")
        print(_summary(print_findings(findings, width=max(len(f.name) for f in findings))))
    return EXIT_PROBLEM if failed else EXIT_OK


# -- worker ----------------------------------------------------------------------------------


def _register_worker(subparsers) -> None:
    from boltzlabs.remote.listener import add_worker_arguments, run_worker

    parser = _subparser(
        subparsers,
        "worker",
        "serve pools to remote clients (RLPool(worker='tcp://...'))",
        """Serve RLPools to clients on other hosts: RLPool(source, n, worker="tcp://HOST:PORT",
token=...). Each client proves it knows the token, ships its env directory
(cached here by content), and gets a worker process and sandboxes of its own.
Listens on loopback unless told otherwise; use TLS off loopback. Prints
"listening on tcp://HOST:PORT" (and the token, when it made one), then runs
until SIGTERM or Ctrl-C, which end every pool.""",
    )
    add_worker_arguments(parser)
    parser.set_defaults(run=run_worker)


# -- the command -----------------------------------------------------------------------------

COMMANDS = [_register_check, _register_bench, _register_doctor, _register_worker]


def build_parser() -> argparse.ArgumentParser:
    """The `boltzlabs` parser, one subcommand per entry of COMMANDS."""
    import boltzlabs

    parser = argparse.ArgumentParser(
        prog="boltzlabs",
        description="Thousands of sandboxed RL environments behind one batched step().",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"boltzlabs {boltzlabs.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv=None) -> int:
    """Run the `boltzlabs` command line; returns its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"boltzlabs {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"boltzlabs {args.command}: interrupted", file=sys.stderr)
        return 130
