"""The per-step CPU budget (RLPool(cpu_budget=)): each lane's CPU, all its processes, against it.

    requests.step / stepping.send --open(lane)-->   the lane's cgroup CPU count now is its base; its
        first check is due at the earliest instant it could pass the budget: now + budget / cores
    lifecycle.poll --check()-->                     each due lane re-read: over it, killed (its whole
        cgroup); else checked again at the next such instant, at least MIN_GAP later
    lifecycle, a reply from a metered lane --at_reply(lane)-->  over it, killed: the reply is dropped
    requests._ask (render, attr) --carry(lane, seq)-->  the window goes on through the request

A lane's window opens when a step is sent to it (a STEP, or the RESET of an
autoreset lane in a step: sync step(), async send(), the gated path alike)
and lasts until its next step or reset is sent, or it dies: its step's own
work, whatever its processes do after the reply (a child or a setsid daemon
left spinning) and any render or attr call meanwhile. Everything in the window
counts against cpu_budget; the lane is killed once it passes it, whether it is
still computing (its step's result is the failure) or idle after its reply (its
next step finds it dead, with the cause). A reset closes the window (a reset
may be costly, and its CPU is not budgeted); the next step opens one again.

The count is the lane's cgroup's (host/cgroups.py: cpuacct.usage on v1,
cpu.stat usage_usec on v2): every task of the sandbox, children and daemons
included, none of which can leave the cgroup. RLIMIT_CPU would count each
process on its own (a fork starts again at 0) and over its whole life.

Nothing polls a lane that cannot be over yet: its tasks use at most `cores`
CPU-seconds per second (the CPUs of its cpuset, host/cgroups.cpus_allowed;
not its affinity, which an env may widen), so a lane with `left` seconds of
budget cannot pass it for left / cores seconds. Each lane has at most one
check queued at a time, whatever its step rate; a check whose window was
renewed meanwhile is put back to the new window's first instant, unread.
A lane is killed at most MIN_GAP (times cores) past its budget, plus the
time the worker's loop takes to come round; at its reply, exactly.

One CpuMeter per pool with a budget, made by Lifecycle (which holds it and
calls check() from poll) and used by requests.py and stepping.py; it kills
through the lifecycle's kill, which it is handed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from boltzlabs.host.cgroups import CgroupPool
from boltzlabs.worker.lanes import CPU_BUDGET, Lane

# The least time between two reads of one lane: near its budget, the next
# earliest instant comes ever sooner, and this bounds how often it is read.
MIN_GAP = 0.005


class CpuMeter:
    """Each lane's CPU time in its window (the module docstring), its checks, and its kill."""

    def __init__(self, budget: float, cgroups: CgroupPool, cores: int, lanes: list[Lane], kill: Callable[..., None]):
        self.budget: float = budget  # CPU seconds per window
        self.cgroups: CgroupPool = cgroups  # each lane's CPU count (counts_cpu)
        self.cores: float = float(max(1, cores))  # how fast a lane can spend it, at most
        self.lanes: list[Lane] = lanes
        self.kill: Callable[..., None] = kill  # Lifecycle.kill(lane, cause, limit)
        n = len(lanes)
        # Per lane: its open window as (generation, seq) of the request that holds it (None: none),
        # its CPU count when the window opened, whether the step's reply came, and the earliest
        # instant it can pass the budget (when its next read is due).
        self.window: list[tuple[int, int] | None] = [None] * n
        self.base: list[float] = [0.0] * n
        self.replied: bytearray = bytearray(n)
        self.next_at: list[float] = [0.0] * n
        # The queued checks, (when, lane), earliest first; queued_at[i]: lane i's earliest queued one.
        self.checks: list[tuple[float, int]] = []
        self.queued_at: list[float] = [float("inf")] * n

    def _open(self, lane: Lane) -> bool:
        """Whether lane's window is still the one its request opened (or carried)."""
        return self.window[lane.index] == (lane.generation, lane.seq) and not lane.state.dead

    def open(self, lane: Lane, seq: int) -> bool:
        """A step (request `seq`) is about to be sent to idle `lane`: its window opens, counted
        from now. False if the window before it was already over the budget: the lane is then
        killed, and nothing is to be sent."""
        i = lane.index
        now = time.monotonic()
        used = self._read(lane)
        if used is None:
            return False
        if self._open(lane) and used - self.base[i] > self.budget:
            self._over(lane, used - self.base[i])
            return False
        self.window[i] = (lane.generation, seq)
        self.base[i] = used
        self.replied[i] = 0
        self._due(i, now + self.budget / self.cores)
        return True

    def carry(self, lane: Lane, seq: int) -> None:
        """A render or attr request `seq` is about to be sent to `lane`: its window, if open, goes on."""
        if self._open(lane):
            self.window[lane.index] = (lane.generation, seq)

    def at_reply(self, lane: Lane) -> bool:
        """`lane`'s reply to its request has come: True if its window is over the budget (it is
        then killed, and the reply must be dropped)."""
        if not self._open(lane):
            return False
        i = lane.index
        now = time.monotonic()
        used = self._read(lane)
        if used is None:
            return True
        used -= self.base[i]
        if used > self.budget:
            self._over(lane, used)
            return True
        self.replied[i] = 1
        self._due(i, now + max(MIN_GAP, (self.budget - used) / self.cores))
        return False

    def next_check(self) -> float:
        """When the earliest queued check is due (inf when none is)."""
        return self.checks[0][0] if self.checks else float("inf")

    def check(self) -> None:
        """Read every lane whose check is due: kill those over the budget, queue the others again."""
        checks = self.checks
        now = time.monotonic()
        while checks and checks[0][0] <= now:
            when, i = heapq.heappop(checks)
            if when == self.queued_at[i]:
                self.queued_at[i] = float("inf")
            lane = self.lanes[i]
            if not self._open(lane):
                self.window[i] = None
                continue
            if self.next_at[i] > now:  # its window was renewed since: not before its new first instant
                self._due(i, self.next_at[i])
                continue
            used = self._read(lane)
            if used is None:
                continue
            used -= self.base[i]
            if used > self.budget:
                self._over(lane, used)
            else:
                self._due(i, now + max(MIN_GAP, (self.budget - used) / self.cores))

    def _due(self, i: int, when: float) -> None:
        self.next_at[i] = when
        if when < self.queued_at[i]:
            self.queued_at[i] = when
            heapq.heappush(self.checks, (when, i))

    def _read(self, lane: Lane) -> float | None:
        """lane's cgroup CPU count (seconds); None when it cannot be read (the lane is then killed:
        a budget that cannot be kept is not kept quietly)."""
        try:
            return self.cgroups.cpu_seconds(lane.index)
        except (OSError, ValueError) as exc:
            self.window[lane.index] = None
            self.kill(lane, f"its CPU time could not be read for its cpu_budget ({exc}), and it was killed", CPU_BUDGET)
            return None

    def _over(self, lane: Lane, used: float) -> None:
        i = lane.index
        self.window[i] = None
        if self.replied[i]:
            cause = (
                f"used {used:.2f} s of CPU since its last step was sent, over its cpu_budget of {self.budget:g} s, "
                "and was killed with every process of its sandbox; its step had replied, and processes it left "
                "running went on"
            )
        else:
            cause = (
                f"used {used:.2f} s of CPU in this step, over its cpu_budget of {self.budget:g} s, and was killed "
                "with every process of its sandbox"
            )
        self.kill(lane, cause, CPU_BUDGET)
