"""The one retry backoff: exact waits for each caller's first delay and cap."""

from __future__ import annotations

import pytest

from batchgen.jobs.backoff import backoff_delay


@pytest.mark.parametrize(
    ("who", "first", "cap", "waits"),
    [
        ("redis reconnect (connect, chunk append)", 0.1, 1.0, [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]),
        ("queue loop, Redis down", 0.1, 5.0, [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]),
        ("sink, part not written", 0.5, 30.0, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]),
        ("supervisor restart", 1.0, 30.0, [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]),
        ("finalize, serve's output files", 2.0, 300.0,
         [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0, 300.0]),
    ],
)  # fmt: skip
def test_the_wait_doubles_from_the_first_up_to_the_cap(who, first, cap, waits):
    assert [backoff_delay(attempt, first, cap) for attempt in range(len(waits))] == waits


def test_the_waits_are_exact_and_never_pass_the_cap():
    assert backoff_delay(0, 0.1, 1.0) == 0.1  # no jitter: the same wait every time
    assert backoff_delay(3, 0.1, 1.0) == 0.1 * 8
    assert backoff_delay(10_000, 0.1, 1.0) == 1.0
    assert backoff_delay(5, 2.0, 2.0) == 2.0
