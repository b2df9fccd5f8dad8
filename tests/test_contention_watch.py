"""The engine goes down to one CPU thread while its stepping thread waits for a CPU
(other processes want them) and back up once they are gone (cpu_threads.ContentionWatch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from batchgen.worker.cpu_threads import ContentionWatch, runqueue_wait_s


class _Clock:
    """A thread's wall clock and its runqueue wait, both moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waited = 7.0  # seconds the thread waited before the engine started

    def run(self, seconds: float, waiting_share: float) -> None:
        self.now += seconds
        self.waited += seconds * waiting_share


def _watch(threads: int = 4) -> tuple[ContentionWatch, _Clock, list[int]]:
    clock = _Clock()
    calls: list[int] = []
    watch = ContentionWatch(
        threads, calls.append, window_s=0.5, clock=lambda: clock.now, waited=lambda: clock.waited
    )
    watch.check()  # the first step: where the windows start
    return watch, clock, calls


def test_drops_to_one_thread_while_waiting_and_comes_back_after_the_hold():
    watch, clock, calls = _watch()
    clock.run(0.4, 0.5)
    watch.check()
    assert calls == []  # not a whole window yet
    clock.run(0.2, 0.5)
    watch.check()
    assert calls == [1] and watch.current == 1  # waited half of 0.6 s
    clock.run(1.0, 0.0)
    watch.check()
    assert calls == [1]  # quiet, but the first hold is 2 s
    clock.run(1.0, 0.0)
    watch.check()
    assert calls == [1, 4] and watch.current == 4
    clock.run(0.6, 0.10)  # between QUIET and BUSY: stays
    watch.check()
    assert calls == [1, 4]


def test_a_neighbour_that_keeps_coming_back_doubles_the_hold_and_a_quiet_minute_resets_it():
    watch, clock, calls = _watch(2)
    holds = []
    for _ in range(4):
        clock.run(0.5, 0.4)
        watch.check()  # down
        assert calls[-1] == 1
        start = clock.now
        while calls[-1] == 1:
            clock.run(0.5, 0.0)
            watch.check()
        holds.append(clock.now - start)
    assert holds == [2.0, 4.0, 8.0, 16.0]
    clock.run(61.0, 0.0)
    watch.check()  # a minute at the full count
    clock.run(0.5, 0.3)
    watch.check()
    start = clock.now
    while calls[-1] == 1:
        clock.run(0.5, 0.0)
        watch.check()
    assert clock.now - start == 2.0


def test_a_low_wait_never_drops_and_one_thread_asked_never_rises():
    watch, clock, calls = _watch()
    for _ in range(20):
        clock.run(0.5, 0.02)
        watch.check()
    assert calls == []
    single, clock, calls = _watch(1)
    clock.run(0.5, 0.9)
    single.check()
    clock.run(5.0, 0.0)
    single.check()
    assert calls == [] and single.current == 1


def test_without_schedstat_the_count_stays_as_set():
    calls: list[int] = []
    watch = ContentionWatch(2, calls.append, window_s=0.0, waited=lambda: None)
    for _ in range(3):
        watch.check()
    assert calls == [] and watch.current == 2


def test_a_real_neighbour_on_the_same_cpu_takes_the_engine_down_to_one_thread():
    """This thread and a busy process pinned to one CPU: the kernel's own count of
    the time this thread waited for it makes the watch drop, no fake clock."""
    if runqueue_wait_s() is None:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        calls: list[int] = []
        watch = ContentionWatch(2, calls.append, window_s=0.3)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            watch.check()  # busy, as a step is: runnable all the time
        assert calls == [1]
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()


def test_the_cpu_engine_watches_and_a_one_thread_engine_does_not(toy_model):
    import torch

    from batchgen import Engine

    before = torch.get_num_threads()
    try:
        two = Engine.from_pretrained(toy_model(), device="cpu", num_kv_blocks=16, threads=2)
        assert two.runner.contention is not None and two.runner.contention.threads == 2
        one = Engine.from_pretrained(toy_model(), device="cpu", num_kv_blocks=16, threads=1)
        assert one.runner.contention is None
    finally:
        torch.set_num_threads(before)
