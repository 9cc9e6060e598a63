"""CoreSharing (backends/cpu/core_sharing.py): the CPU engine runs with the threads other processes
leave idle, gives them back when the other processes stop, and keeps a user's own setting."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from fasterllama.backends.cpu import core_sharing
from fasterllama.backends.cpu.core_sharing import CoreSharing

pytestmark = pytest.mark.skipif(core_sharing._busy_seconds({0}) is None, reason="no /proc/stat")


@pytest.fixture
def threads():
    """Two torch threads for the test, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """/proc/stat and the clocks as a test sets them: `step(others)` lets 1 s pass in which other
    processes use `others` CPUs and this process 1."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall = self.busy = self.own = 0.0
        monkeypatch.setattr(core_sharing, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(core_sharing.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(core_sharing.time, "process_time", lambda: self.own)

    def step(self, others: float) -> None:
        self.wall += 1
        self.own += 1
        self.busy += 1 + others


def test_threads_follow_the_idle_cores(monkeypatch, threads):
    machine = FakeMachine(monkeypatch)
    sharing = CoreSharing(interval=0.5)
    sharing.cpus = {0, 1}
    assert sharing.update() == 2  # first sample: nothing to compare with yet
    for others, expected in [(0.1, 2), (0.9, 1), (1.0, 1), (0.3, 2), (3.0, 1), (0.0, 2)]:
        machine.step(others)
        assert sharing.update() == expected, others
        assert torch.get_num_threads() == expected
        assert sharing.others == pytest.approx(others)
    machine.wall += 0.1  # within the interval: no new sample, no change
    machine.busy += 5
    assert sharing.update() == 2


def test_a_users_thread_count_is_the_most_used(monkeypatch, threads):
    machine = FakeMachine(monkeypatch)
    sharing = CoreSharing(interval=0.5)
    sharing.cpus = {0, 1, 2, 3}
    sharing.update()
    torch.set_num_threads(1)  # the user asks for one thread: idle cores do not bring back more
    machine.step(0.0)
    assert sharing.update() == 1 and torch.get_num_threads() == 1


def test_turned_off(monkeypatch, threads):
    monkeypatch.setenv("FASTERLLAMA_CORE_SHARING", "0")
    machine = FakeMachine(monkeypatch)
    sharing = CoreSharing(interval=0.5)
    sharing.update()
    machine.step(2.0)
    assert sharing.update() == 2 and torch.get_num_threads() == 2


def test_a_busy_process_takes_a_thread(threads):
    """On the real machine: a process spinning on one core leaves this one a single thread."""
    if len(core_sharing.os.sched_getaffinity(0)) != 2:
        pytest.skip("written for a 2-core machine")
    sharing = CoreSharing(interval=0.3)
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        time.sleep(0.5)  # the burner is running
        sharing.update()
        time.sleep(0.6)
        assert sharing.update() == 1, f"others used {sharing.others:.2f} CPUs"
        assert torch.get_num_threads() == 1
    finally:
        burner.kill()
        burner.wait()
