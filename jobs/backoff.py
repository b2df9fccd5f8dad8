"""How long to wait before retrying: the first delay, doubled each time, up to a cap.

Every retry loop of batchgen waits ``backoff_delay(attempt, first, cap)``; each caller
keeps its own ``first`` and ``cap`` (a Redis reconnect starts at 0.1 s, a failed
finalize at 2 s). No jitter: the waits are exact.
"""

from __future__ import annotations


def backoff_delay(attempt: int, first: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (0 for the first): ``first * 2**attempt``, at most
    ``cap`` (also where ``2**attempt`` is past what a float holds)."""
    try:
        return min(first * 2**attempt, cap)
    except OverflowError:  # a finalize that failed 1024 times in a row
        return cap
