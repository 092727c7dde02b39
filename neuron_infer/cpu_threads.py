"""How many CPU threads the compiled graphs use: chosen from the CPUs this process may run on and their load.

Why: a decode step runs several hundred OpenMP parallel regions, each ending in a barrier that waits for every
thread of the team. When another process keeps one of the cores busy, the scheduler deschedules one of our
threads for a whole time slice and every barrier waits for it; a 2-thread decode on 2 cores then collapses to a
few tokens per second, while one thread keeps one core to itself and runs at full speed. So:

    use("auto")            at load (CLI `generate`, `CompiledModel.load`, each tensor-parallel rank)
      -> CPUs = sched_getaffinity, capped by a cgroup CPU quota        (what this process may use at all)
      -> others = busy time of those CPUs (/proc/stat) - our own CPU time, over a short window
      -> threads = choose_threads(CPUs, others, cap)                   (pure; see its docstring)
    tick()                 before every graph call (backends/cpu/graph.py): re-sample at most every PERIOD_S seconds and
                           torch.set_num_threads when the answer changes (in the thread that runs the graphs)
    use(n)                 a fixed count (--threads n, or OMP_NUM_THREADS in the environment): never re-evaluated

The OpenMP wait policy is left at libgomp's default (spin, then sleep): threads are only added when their CPUs
are free, where spinning is the fast choice (docs/cpu-backend.md, "Threads on a busy machine").
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from neuron_infer.errors import ConfigError

PERIOD_S = 0.5  # how often tick() re-samples the load (one /proc/stat read; its cost: docs/cpu-backend.md)
FIRST_WINDOW_S = 0.05  # the window of the first sample, taken at load
SLACK = 0.25  # CPUs that others may keep busy before we give one up (background noise; see choose_threads)


def choose_threads(cpus: int, others_busy: float, cap: int | None = None) -> int:
    """Threads for our graphs on `cpus` usable CPUs while other processes keep `others_busy` CPUs busy.

    Every thread of an OpenMP team must run for each of its barriers, so we take only the CPUs others leave free:
    floor(cpus - others_busy + SLACK), at least 1 and at most `cap` (a tensor-parallel rank's share). SLACK lets
    short-lived background work (a shell, a logger) pass unnoticed; a process that keeps a CPU busy does not.
    """
    if cpus < 1:
        raise ValueError(f"cpus={cpus} must be >= 1")
    free = math.floor(cpus - max(0.0, others_busy) + SLACK)
    return max(1, min(free, cpus, cap if cap is not None else cpus))


def usable_cpus(affinity: set[int] | None = None, cpu_max: str | None = None) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 quota ("max 100000" = none)."""
    n = len(affinity if affinity is not None else _affinity())
    text = cpu_max if cpu_max is not None else _read("/sys/fs/cgroup/cpu.max")
    parts = (text or "").split()
    if len(parts) == 2 and parts[0] != "max":
        try:
            n = min(n, max(1, math.ceil(int(parts[0]) / int(parts[1]))))
        except (ValueError, ZeroDivisionError):
            pass
    return max(1, n)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative busy seconds of the given CPUs, our own CPU seconds, and the wall clock, at one instant."""

    busy_s: float
    own_s: float
    wall_s: float


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """CPUs kept busy by other processes between two samples (their busy time minus ours, per wall second)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall)


def parse_proc_stat(text: str, cpus: set[int]) -> float:
    """Busy seconds (everything but idle and iowait) summed over the `cpuN` lines of /proc/stat named in `cpus`."""
    hz = _clock_ticks()
    busy = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
        busy += sum(ticks[:8]) - ticks[3] - ticks[4]
    return busy / hz


def sample(cpus: set[int]) -> CpuSample | None:
    """One reading of /proc/stat for `cpus`, or None where it does not exist (not Linux)."""
    text = _read("/proc/stat")
    if text is None:
        return None
    return CpuSample(parse_proc_stat(text, cpus), time.process_time(), time.monotonic())


class Governor:
    """Keeps torch's thread count at choose_threads(...) of the current load (see the module docstring)."""

    def __init__(self, cap: int | None = None, period_s: float = PERIOD_S):
        self.cap, self.period_s = cap, period_s
        self.affinity = _affinity()
        self.cpus = usable_cpus(self.affinity)
        self.last: CpuSample | None = None
        self.threads = 0

    def start(self) -> int:
        """Measure the load over a short window now and set the thread count from it."""
        first = sample(self.affinity)
        if first is None:  # no /proc/stat: every usable CPU, as torch would
            return self._apply(min(self.cpus, self.cap or self.cpus))
        time.sleep(FIRST_WINDOW_S)
        self.last = first
        return self._update(sample(self.affinity))

    def tick(self) -> None:
        """Re-evaluate when the last sample is older than period_s (cheap otherwise: one clock read)."""
        if self.last is not None and time.monotonic() - self.last.wall_s >= self.period_s:
            self._update(sample(self.affinity))

    def _update(self, now: CpuSample | None) -> int:
        if now is None or self.last is None:
            return self.threads
        n = choose_threads(self.cpus, others_busy(self.last, now), self.cap)
        self.last = now
        return self._apply(n)

    def _apply(self, n: int) -> int:
        if n != self.threads:
            import torch

            torch.set_num_threads(n)
            self.threads = n
        return n


_governor: Governor | None = None


def use(threads: int | str = "auto", cap: int | None = None) -> int:
    """Set the graphs' thread count: an int fixes it; "auto" follows the load (OMP_NUM_THREADS, when set, is taken
    as a fixed count). Returns the count now in effect."""
    global _governor
    env = os.environ.get("OMP_NUM_THREADS", "")
    if threads == "auto" and env.isdigit() and int(env) > 0:
        threads = min(int(env), cap) if cap else int(env)
    if threads == "auto":
        _governor = Governor(cap)
        return _governor.start()
    top = max_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= top:
        raise ConfigError(f"threads={threads!r} must be an int >= 1 or 'auto' (at most {top}: 4 per CPU of this "
                          "machine)")
    import torch

    _governor = None
    torch.set_num_threads(threads)
    return threads


def max_threads() -> int:
    """The largest fixed thread count accepted: 4 per CPU (more only thrashes, and a huge count exhausts memory)."""
    return 4 * (os.cpu_count() or 1)


def tick() -> None:
    """Called before each graph call: lets an "auto" thread count follow the load (no-op otherwise)."""
    if _governor is not None:
        _governor.tick()


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None
