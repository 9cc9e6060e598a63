"""Use only the cores that other processes leave idle.

A decode step runs a few hundred short OpenMP regions, and between them libgomp's idle threads
spin (GOMP_SPINCOUNT, 300,000 rounds by default), so a step never waits for a thread to wake up.
That is the fastest policy for a process that has the cores to itself, and the worst for two that
share them: each one's spinning threads hold the cores the other's working threads need, and two
processes decoding on this 2-core machine fell to 17% of their solo speed each. With one thread
each, the pair keeps about 58% (docs/performance.md, "Sharing the machine").

So before each engine step, at most every `interval` seconds, CoreSharing measures how much CPU
time other processes took on the cores this process may run on (/proc/stat less this process's
own time) and sets torch's thread count, which the C kernels share, to the cores they left:
between 1 and the thread count that torch had when the engine started. A process alone keeps all
its threads and its full speed. `FASTERLLAMA_CORE_SHARING=0` turns this off (fixed thread count)."""

from __future__ import annotations

import os
import time

import torch


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds the given CPUs spent busy since boot (steal excluded: not ours to take back);
    None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
            busy += user + nice + system + irq + softirq
    return busy / os.sysconf("SC_CLK_TCK")


class CoreSharing:
    """Sets torch's thread count to the cores other processes leave idle (see the module docstring).
    Call `update()` from the thread that runs the model: OpenMP thread counts are per thread."""

    def __init__(self, max_threads: int | None = None, interval: float = 0.5) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval = interval
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.threads = self.max_threads
        self.enabled = (self.max_threads > 1 and os.environ.get("FASTERLLAMA_CORE_SHARING", "1") != "0"
                        and _busy_seconds(self.cpus) is not None)
        self._last: tuple[float, float, float] | None = None  # (wall, machine busy, own CPU) seconds
        self.others = 0.0  # CPUs other processes used during the last interval

    def update(self) -> int:
        """The thread count to run the next step with (set in torch when it changes)."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        if torch.get_num_threads() != self.threads:  # set by the user since: their count is the most to use
            self.max_threads = self.threads = torch.get_num_threads()
        sample = (now, _busy_seconds(self.cpus) or 0.0, time.process_time())
        if self._last is not None:
            wall = sample[0] - self._last[0]
            self.others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall
            threads = min(self.max_threads, max(1, round(len(self.cpus) - self.others)))
            if threads != self.threads:
                torch.set_num_threads(threads)
                self.threads = threads
        self._last = sample
        return self.threads
