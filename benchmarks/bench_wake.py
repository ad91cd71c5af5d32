"""What waking N envs costs the waker, by wake-up mechanism (issue 16).

    python benchmarks/bench_wake.py                          # n = 64 and 512, ~2 s per run, 3 repeats
    python benchmarks/bench_wake.py --n 8 --repeat 1         # a quick look (~35 s)
    python benchmarks/bench_wake.py --modes pipe bcast --sched other --rounds 5000
    python benchmarks/bench_wake.py --modes pipe bcast shm shm+wake --sched other --nap-divisor 2

No boltzlabs, no sandbox, no Python in the timed loop: this script compiles
benchmarks/wake_bench.c with `cc -O2` into a temporary directory and runs it
once per (n, mode, children's scheduling policy). Each run is a parent and n
forked children doing rounds of the worker's step in miniature: wake every
child, each answers with one 16-byte write to its own reply pipe, the parent
waits in epoll (napping between waits as native/fastpath.c's nap() does) and
reads every reply. The modes are how the parent wakes the children, and in
the shm modes how the replies come back (the C file's comment has the details):

    pipe        a write per child to its request pipe (today's channel)
    futex       a futex word per child in shared memory, a FUTEX_WAKE per child
    bcast       one shared word, one FUTEX_WAKE(INT_MAX) for all
    pipe+bcast  a write per child to a pipe nobody sleeps on, then one broadcast wake
    uring       the per-child pipe writes submitted in one io_uring_enter
                (left out, with a note, when io_uring_setup is refused here)
    shm         the whole channel in shared memory: requests in per-child slots and
                one broadcast wake; each reply into the child's own slot (payload,
                then its sequence word); the parent naps and scans the slots, no
                system call per child on its side
    shm+wake    as shm, but each reply also rings a doorbell futex (FUTEX_WAKE(1));
                the parent sleeps in FUTEX_WAIT on it instead of napping blind

Each with the children SCHED_OTHER and SCHED_BATCH. Without --rounds, a short
calibration run per configuration sets its rounds so a run takes about
--seconds. The runs are interleaved (every configuration once, then again:
ABCABC), so load from elsewhere hits all alike; each figure is the median over
--repeat runs, with its spread (min-max). Printed: the load average before
and after, and a markdown table per n of the parent's user and system CPU per
child-round (getrusage), the parent's total over the first configuration's
(pipe/other by default) in the same repeat (paired: the runs were seconds
apart), the part of the parent's CPU spent waking (writing the requests and
the wake-up calls), the children's CPU, child-rounds per second and the
parent's waits per round (epoll waits; in the shm modes its nanosleep and
FUTEX_WAIT calls). --nap-divisor builds the program with another divisor in
the fan-in's nap rule (native/fastpath.c's is 8), for every mode. Everything, with the machine and the load, goes
to benchmarks/results/wake.json (git-ignored). A run that does not finish
within --timeout seconds is killed (its children die with it) and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "wake_bench.c"
MODES = ["pipe", "futex", "bcast", "pipe+bcast", "uring", "shm", "shm+wake"]
SCHEDS = ["other", "batch"]
FIGURES = [
    "parent_user_us",
    "parent_sys_us",
    "parent_us",
    "parent_wake_us",
    "child_us",
    "child_rounds_per_s",
    "waits_per_round",
]
UNAVAILABLE = 3  # wake_bench's exit status for a mode this machine refuses (io_uring)


class RunFailed(RuntimeError):
    """One wake_bench run failed, hung past its timeout or printed something unreadable."""


def build(cc: str, directory: Path, name: str = "wake_bench", nap_divisor: float | None = None) -> Path:
    """Compile wake_bench.c with `cc -O2` into `directory` (with NAP_DIVISOR set to
    `nap_divisor` when given); exits 1 with a message when there is no compiler or
    the build fails."""
    compiler = shutil.which(cc)
    if compiler is None:
        sys.exit(
            f"bench_wake: no C compiler ({cc!r} is not on PATH): install one "
            "(`apt-get install gcc`, or `bash ci/setup.sh`) or name it with --cc / $CC"
        )
    binary = directory / name
    divisor = [] if nap_divisor is None else [f"-DNAP_DIVISOR={float(nap_divisor)!r}"]
    done = subprocess.run(
        [compiler, "-O2", "-Wall", *divisor, "-o", str(binary), str(SOURCE)], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"bench_wake: {cc} could not build {SOURCE}:\n{done.stderr}")
    return binary


def run(binary: Path, mode: str, sched: str, n: int, rounds: int, timeout: float) -> dict | None:
    """One run's figures, or None when the mode cannot run on this machine.
    Raises RunFailed on an error or a hang (the run is killed, children and all)."""
    proc = subprocess.Popen(
        [str(binary), mode, sched, str(n), str(rounds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        err = _stop(proc)
        raise RunFailed(
            f"{mode}/{sched} n={n} rounds={rounds} did not finish in {timeout:.0f} s "
            f"and was killed; its stderr: {err.strip() or '(none)'}"
        ) from None
    except BaseException:  # Ctrl-C in this script: the run goes too
        _stop(proc)
        raise
    if proc.returncode == UNAVAILABLE:
        return None
    if proc.returncode != 0:
        raise RunFailed(f"{mode}/{sched} n={n} rounds={rounds} exited with {proc.returncode}: {err.strip()}")
    try:
        figures = json.loads(out)
    except ValueError:
        raise RunFailed(f"{mode}/{sched} n={n}: unreadable output {out[:200]!r}") from None
    figures["parent_us"] = figures["parent_user_us"] + figures["parent_sys_us"]
    figures["child_us"] = figures["child_user_us"] + figures["child_sys_us"]
    return figures


def _stop(proc: subprocess.Popen) -> str:
    """End a run: SIGTERM makes wake_bench kill and reap its children; SIGKILL, if it
    must, kills them too (their parent-death signal). Returns its stderr."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=5)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def unavailable_note(binary: Path) -> str | None:
    """Why uring cannot run here (wake_bench's message), or None when it can."""
    done = subprocess.run([str(binary), "uring", "other", "1", "1"], capture_output=True, text=True, timeout=30)
    return done.stderr.strip() if done.returncode == UNAVAILABLE else None


def calibrate(binary: Path, config: tuple, n: int, seconds: float, timeout: float) -> int:
    """Rounds for a run of about `seconds`, from a short run (~1/10 of it)."""
    probe = max(20, 20_000 // n)
    figures = run(binary, *config, n, probe, timeout)
    rate = figures["child_rounds_per_s"] / n
    return max(20, int(seconds * rate))


def spread(values: list) -> dict:
    """Median, min and max of one figure over the repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cell(figure: dict, digits: int = 2) -> str:
    """'median (min-max)' for a table cell."""
    if figure["min"] == figure["max"]:
        return f"{figure['median']:,.{digits}f}"
    return f"{figure['median']:,.{digits}f} ({figure['min']:,.{digits}f}-{figure['max']:,.{digits}f})"


def table(n: int, summary: dict) -> str:
    """The markdown table of one n: one row per configuration."""
    base = "/".join(next(iter(summary)))
    lines = [
        f"n = {n}: CPU microseconds per child-round, median (min-max) over the repeats; "
        f"'parent / {base}' is the parent total over {base}'s in the same repeat",
        "",
        f"| mode | children | parent user | parent sys | parent total | parent / {base} | parent waking "
        "| children total | child-rounds/s | waits/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, sched), figures in summary.items():
        lines.append(
            f"| {mode} | {sched} | {cell(figures['parent_user_us'])} | {cell(figures['parent_sys_us'])} | "
            f"**{cell(figures['parent_us'])}** | {cell(figures['parent_vs_base'])} | "
            f"{cell(figures['parent_wake_us'])} | {cell(figures['child_us'])} | "
            f"{cell(figures['child_rounds_per_s'], 0)} | {cell(figures['waits_per_round'])} |"
        )
    return "\n".join(lines)


def git_commit() -> str:
    """This checkout's commit, or '' outside git."""
    done = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 512], help="children per run (default 64 512)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--sched", nargs="+", choices=SCHEDS, default=SCHEDS, help="the children's policy")
    parser.add_argument("--rounds", type=int, help="rounds per run (default: calibrated to --seconds)")
    parser.add_argument("--seconds", type=float, default=2.0, help="target length of one run (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration, interleaved (default 3)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a run is called hung (default 60)")
    parser.add_argument(
        "--nap-divisor",
        type=float,
        default=8.0,
        help="the fan-in nap's divisor, built into the program (default 8, as native/fastpath.c)",
    )
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"), help="C compiler (default $CC or cc)")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "wake.json")
    args = parser.parse_args()
    if min(args.n) < 1 or args.repeat < 1 or (args.rounds is not None and args.rounds < 1) or args.seconds <= 0:
        parser.error("--n, --repeat and --rounds must be >= 1 and --seconds > 0")
    if not 1 <= args.nap_divisor <= 1000:  # also refuses nan and inf
        parser.error("--nap-divisor must be between 1 and 1000")

    load_before = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)} ({os.cpu_count()} cpus)", file=sys.stderr)
    notes = []
    with tempfile.TemporaryDirectory(prefix="bench_wake_") as directory:
        binary = build(args.cc, Path(directory), nap_divisor=args.nap_divisor)
        modes = list(args.modes)
        if "uring" in modes:
            why = unavailable_note(binary)
            if why:
                modes.remove("uring")
                notes.append(f"uring left out: {why}")
                print(notes[-1], file=sys.stderr)
        configs = [(mode, sched) for mode in modes for sched in args.sched]
        summary, raw = {}, {}
        try:
            for n in args.n:
                rounds = {
                    config: args.rounds or calibrate(binary, config, n, args.seconds, args.timeout)
                    for config in configs
                }
                raw[n] = {config: [] for config in configs}
                for repeat in range(args.repeat):
                    for config in configs:  # interleaved: ABCABC
                        figures = run(binary, *config, n, rounds[config], args.timeout)
                        raw[n][config].append(figures)
                        print(
                            f"n={n} {config[0]}/{config[1]} #{repeat + 1}: parent {figures['parent_us']:.2f} us, "
                            f"{figures['child_rounds_per_s']:,.0f} child-rounds/s",
                            file=sys.stderr,
                            flush=True,
                        )
                summary[n] = {
                    config: {figure: spread([r[figure] for r in raw[n][config]]) for figure in FIGURES}
                    for config in configs
                }
                base = configs[0]
                for config in configs:  # paired: each run against the baseline's run of the same repeat
                    summary[n][config]["parent_vs_base"] = spread(
                        [mine["parent_us"] / theirs["parent_us"] for mine, theirs in zip(raw[n][config], raw[n][base])]
                    )
        except RunFailed as error:
            sys.exit(f"bench_wake: {error}")
    load_after = os.getloadavg()

    for n in args.n:
        print(table(n, summary[n]))
        print()
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); "
        f"{os.cpu_count()} cpus; {args.repeat} repeat(s); nap divisor {args.nap_divisor:g}"
    )
    for note in notes:
        print(note)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "load_before": load_before,
        "load_after": load_after,
        "repeat": args.repeat,
        "seconds": args.seconds,
        "nap_divisor": args.nap_divisor,
        "notes": notes,
        "results": [
            {"n": n, "mode": mode, "sched": sched, **summary[n][(mode, sched)], "runs": raw[n][(mode, sched)]}
            for n in args.n
            for (mode, sched) in configs
        ],
    }
    args.json.write_text(json.dumps(record, indent=1))
    print(f"figures: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
