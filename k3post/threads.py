"""The thread policy: how many torch / OpenMP threads each process of a command runs.

``run.threads`` is the number of threads a command keeps busy at once, over all the processes it runs at the
same time (the trainer, the demo's no-QAT SFT run and its RL domain workers, local engine servers, trainer ranks).
Each of ``W`` concurrent processes gets ``max(1, budget // W)`` threads (`plan_threads`, a pure function):

* ``run.threads: 0`` (the default, "auto"): the budget is the cores this process may use: the CPU count, cut to
  the CPU affinity mask (``os.sched_getaffinity``), to the cgroup CPU quota rounded down (``cpu.max`` of
  cgroup v2, ``cpu.cfs_quota_us / cpu.cfs_period_us`` of v1, the tightest of the process's cgroup and its
  parents) and to ``OMP_NUM_THREADS`` when the environment sets it (a CI runner's or a user's cap), at least 1. A quota of 1.5 CPUs gives 1 thread: two busy threads would be throttled for a quarter
  of every period, and an OpenMP barrier waits for the slower one.
* ``run.threads: N`` (N > 0, the shipped configs pin 2): the budget is N whatever the machine. A matmul's reduction
  order, so every number a run prints, depends on the thread count; a pinned count makes runs repeat on another
  machine. N above the usable cores is honoured with a warning (the threads contend).

A process never gets fewer than one thread, so W workers over the cores still time-share (single-threaded
processes, which do not spin-wait on each other). `use_threads` applies a plan to this process
(``torch.set_num_threads``, ``set_num_interop_threads`` where torch still allows it) and to the processes it
starts (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``: a spawned child's OpenMP starts with them, `child_threads`
reads them back); `record_plan` (called by `k3post.runs.open_run`) writes the plan in force to the run's
``k3post.log`` and ``threads.json``, which the report shows: the thread count the numbers were made with.

Idle OpenMP workers sleep (`quiet_waits`: ``OMP_WAIT_POLICY=PASSIVE``, set by the ``k3post`` command before torch
loads its OpenMP runtime, inherited by every process it starts; a value the environment already has wins).
libgomp's default spins a waiting worker for ~300,000 iterations before it sleeps: fine on cores nobody else wants,
but beside other work (another k3post process, a CI job, a user's editor) the spinning threads take the cores the
others need, and a step that waits at a barrier for a descheduled thread waits a whole time slice.
`bench/threads_load.py` measures both policies, quiet and beside a CPU hog (docs/decisions.md, "Issue 32 §waits").

A child a command starts (the demo's no-QAT SFT, the RL domain and draft workers, trainer ranks) calls
`exit_with_parent` first: when the command is killed (SIGTERM or SIGKILL, which run no cleanup in it) the child
exits too, instead of training on for minutes beside the rerun that resumes the same folders.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3post.io import atomic_write

__all__ = ["Cores", "ThreadPlan", "plan_threads", "seen_cores", "cgroup_quota", "use_threads", "child_threads",
           "record_plan", "active_plan", "command_plan", "quiet_waits", "wait_policy", "THREAD_ENV", "WAIT_ENV",
           "RECORD", "RANKS"]

log = logging.getLogger("k3post.threads")

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The variables a child process's OpenMP / MKL read at start (set by `use_threads`)."""
WAIT_ENV = ("OMP_WAIT_POLICY", "PASSIVE")
"""The variable and value `quiet_waits` sets: idle OpenMP workers sleep instead of spinning."""
RANKS = "trainer ranks"
"""The role name of a command's local trainer ranks > 0 in its plan (`command_plan`)."""
RECORD = "threads.json"
"""The run folder's record of the plans its commands ran under (`record_plan`)."""


@dataclass(frozen=True)
class Cores:
    """What this process may run on: ``cpu_count`` (os.cpu_count), ``affinity`` (CPUs in its affinity mask;
    None where the platform has none), ``quota`` (the cgroup CPU quota in CPUs; None when unlimited) and
    ``env_limit`` (``OMP_NUM_THREADS`` as the command found it; None when unset)."""

    cpu_count: int
    affinity: int | None = None
    quota: float | None = None
    env_limit: int | None = None

    @property
    def usable(self) -> int:
        """The cores busy threads may keep: the least of the three (the quota rounded down), at least 1."""
        n = self.cpu_count
        if self.affinity is not None:
            n = min(n, self.affinity)
        if self.quota is not None:
            n = min(n, math.floor(self.quota))
        if self.env_limit is not None:
            n = min(n, self.env_limit)
        return max(1, n)

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        env = "" if self.env_limit is None else f", OMP_NUM_THREADS {self.env_limit}"
        return (f"{self.cpu_count} CPUs, affinity {self.affinity if self.affinity is not None else 'n/a'}, "
                f"cgroup quota {quota}{env}")


@dataclass(frozen=True)
class ThreadPlan:
    """The threads of each process of a command (`plan_threads`)."""

    per_process: int  # torch intra-op threads (and interop, OMP, MKL) of each concurrent process
    workers: dict[str, int]  # the processes that run at the same time, by role
    requested: int  # run.threads: 0 = auto
    budget: int  # the threads the command keeps busy at most (run.threads, or the usable cores)
    cores: Cores
    reason: str  # why this count, in words
    warnings: tuple[str, ...] = field(default=())

    @property
    def total_workers(self) -> int:
        return sum(self.workers.values())

    def describe(self) -> str:
        who = ", ".join(f"{n} {k}" for k, n in self.workers.items())
        return (f"{self.per_process} torch thread(s) per process ({who}); {self.reason}; cores seen: "
                f"{self.cores.describe()} -> {self.cores.usable} usable")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cores"]["usable"] = self.cores.usable
        d["warnings"] = list(self.warnings)
        return d


def plan_threads(cores: Cores, workers: Mapping[str, int], requested: int = 0, *, key: str = "run.threads") -> ThreadPlan:
    """The policy (module doc): ``requested`` (the setting ``key``; 0 = auto) threads shared by the ``workers``
    (role -> number of processes running at once), each process at least one thread. Pure: no system reads."""
    if requested < 0:
        raise ValueError(f"{key} must be >= 0 (0: chosen from the cores), got {requested}")
    counts = {k: int(n) for k, n in workers.items() if n > 0}
    if not counts:
        raise ValueError(f"a thread plan needs at least one process, got {dict(workers)}")
    w = sum(counts.values())
    usable = cores.usable
    budget = requested or usable
    per = max(1, budget // w)
    if requested:
        reason = f"{key}={requested} pinned (the numbers are those of this count on any machine)"
    else:
        reason = f"{key}=0 (auto): the {usable} usable core(s)"
    reason += f" shared by {w} process(es)" if w > 1 else ""
    warnings = []
    if requested > usable:
        warnings.append(f"{key}={requested} is more than the {usable} core(s) this process may use "
                        f"({cores.describe()}): the threads will contend for them (kept, since the numbers depend "
                        f"on the thread count; set {key}={usable} or 0 for speed)")
    elif per * w > usable:
        warnings.append(f"{w} processes at {per} thread(s) each keep {per * w} threads busy on {usable} usable "
                        f"core(s): they time-share")
    return ThreadPlan(per, counts, requested, budget, cores, reason, tuple(warnings))


def cgroup_quota(root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs) of this process's cgroup and its parents, v2 (``cpu.max``) or v1
    (``cpu/cpu.cfs_quota_us``); None when there is none or the files cannot be read."""
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), "/")
    v1 = next((ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and "cpu" in ln.split(":", 2)[1].split(",")), "/")
    quotas = []
    for rel, read in ((v2, _quota_v2), (v1, _quota_v1)):
        d = Path(rel.lstrip("/"))
        for folder in [d, *d.parents]:
            q = read(root, folder)
            if q is not None:
                quotas.append(q)
    return min(quotas) if quotas else None


def _quota_v2(root: Path, folder: Path) -> float | None:
    try:
        quota, period = (root / folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(root: Path, folder: Path) -> float | None:
    try:
        quota = int((root / "cpu" / folder / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def seen_cores() -> Cores:
    """This process's `Cores`, read from the system; under a plan (`use_threads`), the outermost plan's (the
    OMP_NUM_THREADS in the environment then is the plan's, not the user's)."""
    if _active:
        return _active[0][1].cores
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        affinity = None
    return Cores(os.cpu_count() or 1, affinity, cgroup_quota(), _env_threads())


_active: list[tuple[str, ThreadPlan]] = []  # (name, plan) of each `use_threads` block open in this process


def active_plan() -> tuple[str, ThreadPlan] | None:
    """The innermost plan in force in this process (``use_threads``), with its name."""
    return _active[-1] if _active else None


@contextmanager
def use_threads(plan: ThreadPlan, name: str, run: str | Path | None = None) -> Iterator[ThreadPlan]:
    """Run the block under ``plan``: this process's torch threads and the OMP / MKL variables its children
    inherit; the previous values come back afterwards. With ``run`` (an open run folder) the plan is recorded
    there at once (`record_plan`); without, `k3post.runs.open_run` records it when the command opens its folder."""
    import torch

    before = torch.get_num_threads()
    env_before = {k: os.environ.get(k) for k in THREAD_ENV}
    torch.set_num_threads(plan.per_process)
    try:  # allowed once per process, before any inter-op work; later it stays as it is (recorded)
        torch.set_num_interop_threads(plan.per_process)
    except RuntimeError:
        pass
    for k in THREAD_ENV:
        os.environ[k] = str(plan.per_process)
    _active.append((name, plan))
    for w in plan.warnings:
        log.warning("threads (%s): %s", name, w)
    if run is not None:
        record_plan(run)
    try:
        yield plan
    finally:
        _active.pop()
        torch.set_num_threads(before)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet_waits() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` (`WAIT_ENV`) in this process's environment unless it is set already, and
    return `wait_policy`. Only effective before torch is imported (libgomp reads it when it loads), and in every
    process started afterwards: the ``k3post`` command calls it first thing."""
    key, value = WAIT_ENV
    if "torch" not in sys.modules:
        os.environ.setdefault(key, value)
    return wait_policy()


def wait_policy() -> str:
    """The OpenMP wait policy in the environment, in words (what this process's children run with)."""
    key, _ = WAIT_ENV
    got = os.environ.get(key)
    return f"{key}={got}" if got else f"{key} unset (libgomp spins, then sleeps)"


PARENT_ENV = "K3POST_PARENT_PID"  # set by a command for the k3post processes it launches (`k3post serve` servers)


def exit_with_parent(poll_s: float = 0.5, parent: int | None = None) -> None:
    """In a child process: exit at once (status 1, no cleanup) when the process that started it is gone (the
    child is re-parented, so ``os.getppid`` changes), checked every ``poll_s`` seconds by a daemon thread. What
    the child wrote stays as a killed run leaves it: every stage resumes from its checkpoints. The parent is the
    one given, else the one multiprocessing names (so a parent killed while the child was still starting is
    noticed too), else the current one."""
    import multiprocessing

    known = multiprocessing.parent_process()
    if parent is None:
        parent = known.pid if known is not None and known.pid is not None else os.getppid()
    started_by = os.getppid()

    def alive() -> bool:
        if started_by == parent:  # started by the parent itself (spawn, Popen)
            return os.getppid() == parent
        # started for the parent by a fork server (`k3post.workers`), or re-parented already: the server's
        # child as long as the parent lives (the server exits with the parent, which re-parents this one)
        return os.getppid() == started_by and pid_alive(parent)

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="k3post-exit-with-parent", daemon=True).start()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a process that exited but was not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS): os.kill's answer
        return True


def child_threads(default: int = 1) -> int:
    """The thread count a child process started under a plan should run (``OMP_NUM_THREADS`` its parent set);
    ``default`` when there is none or it is not a positive integer."""
    return _env_threads() or default


def _env_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, else None."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n > 0 else None


def record_plan(run: str | Path) -> dict[str, Any] | None:
    """Write the plan in force (`active_plan`) to the log (so to the run's ``k3post.log``) and append it to
    ``<run>/threads.json``, with the torch thread counts read back; returns the entry (None: no plan)."""
    import torch

    got = active_plan()
    if got is None:
        return None
    name, plan = got
    entry = {"name": name, **plan.to_dict(), "torch_threads": torch.get_num_threads(),
             "torch_interop_threads": torch.get_num_interop_threads(), "wait_policy": wait_policy()}
    log.info("threads (%s): %s; torch.get_num_threads()=%d, interop %d: the numbers of this run are made with %d "
             "thread(s) per process; %s", name, plan.describe(), entry["torch_threads"], entry["torch_interop_threads"],
             entry["torch_threads"], entry["wait_policy"])
    path = Path(run) / RECORD
    try:
        old = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:  # a torn record: start it again rather than fail the command
        old = []
    atomic_write(path, json.dumps([*old, entry], indent=1))
    return entry


def command_plan(cfg: Any, command: str, *, workers: Mapping[str, int] | None = None,
                 cores: Cores | None = None) -> ThreadPlan:
    """The plan of ``k3post <command>`` under config ``cfg`` (a `K3Config`): ``workers``, or the processes the
    command keeps busy at once: the trainer (rank 0), its local trainer ranks (``distributed.fsdp.ranks``
    without Ray) and the engine servers it launches (``*.engine.launch``; ``engine.launch_threads``, when set,
    overrides their count). Ray actors run on their bundles with one thread each, not counted here."""
    if workers is None:
        workers = {"trainer": 1}
        if not cfg.distributed.enabled and cfg.distributed.fsdp.ranks > 1 and command in ("sft", "rl", "experts", "mopd"):
            workers[RANKS] = cfg.distributed.fsdp.ranks - 1
        engine = cfg.mopd.rl.rollout.engine if command == "mopd" else cfg.rl.rollout.engine
        if command in ("rl", "experts", "mopd") and engine.kind == "http" and engine.launch:
            workers["engine servers"] = engine.launch
    return plan_threads(cores or seen_cores(), workers, cfg.run.threads)
