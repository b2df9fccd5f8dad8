"""Validating a line costs time and memory linear in its length, whatever its shape.

Memory is counted exactly (tracemalloc sees every allocation, the regex engine's
too); time is the process's CPU time, best of three. Costs are compared between a
line and one four times longer with a generous factor (a quadratic step gives 16).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import pytest

from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.schema.sampling import DEFAULTS

MiB = 1 << 20


def _repeat(unit: str, n: int, sep: str = ",") -> str:
    return sep.join([unit] * max(1, n // (len(unit) + len(sep))))


# Each builds a line of about n bytes.
SHAPES: dict[str, Callable[[int], str]] = {
    "brackets in a string": lambda n: '{"prompt": "' + "[{" * (n // 2) + '"}',
    "escapes in a string": lambda n: '{"prompt": "' + '\\"[\\\\\\n' * (n // 8) + '"}',
    "many small numbers": lambda n: '{"prompt": "x", "metadata": {"a": [' + _repeat("7", n) + "]}}",
    "nested to the depth limit": lambda n: (
        '{"prompt": "x", "metadata": {"a": [' + _repeat("[" * 28 + "1" + "]" * 28, n) + "]}}"
    ),
    "many keys": lambda n: (
        '{"prompt": "x", "metadata": {' + ",".join(f'"k{i}": {i}' for i in range(n // 12)) + "}}"
    ),
    "a duplicate key last": lambda n: (
        '{"prompt": "x", "metadata": {'
        + ",".join(f'"k{i}": [{i}]' for i in range(n // 14))
        + ', "k0": 1}}'
    ),
    "NaN last": lambda n: (
        '{"prompt": "x", "metadata": {"a": [' + _repeat("[1]", n) + ']}, "temperature": NaN}'
    ),
    "a 21-digit integer last": lambda n: (
        '{"prompt": "x", "metadata": {"a": [' + _repeat("[1]", n) + "]}, "
        '"seed": 100000000000000000000}'
    ),
    "an unknown field last": lambda n: (
        '{"prompt": "x", "metadata": {"a": [' + _repeat('{"b": "]}"}', n) + ']}, "extra": 1}'
    ),
    "a huge unknown key": lambda n: '{"prompt": "x", "' + "k" * n + '": 1}',
    "a lone surrogate last": lambda n: '{"prompt": "' + "\\ud83d\\ude00" * (n // 12) + '\\ud800"}',
    "too deep, late": lambda n: (
        '{"prompt": "' + "x" * n + '", "metadata": ' + "[" * 40 + "]" * 40 + "}"
    ),
    "many messages": lambda n: (
        '{"messages": [' + _repeat('{"role": "user", "content": "[hi]"}', n) + "]}"
    ),
    "mostly spaces": lambda n: '{"prompt": "x"' + " " * n + "}",
    "many empty objects": lambda n: (
        '{"prompt": "x", "metadata": {"a": [' + _repeat("{}", n) + "]}}"
    ),
}


def _peak_bytes(line: bytes) -> int:
    tracemalloc.start()
    try:
        parse_line(1, line, DEFAULTS)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _cpu_seconds(line: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        parse_line(1, line, DEFAULTS)
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("shape", SHAPES)
def test_cost_grows_linearly(shape: str):
    # small enough that every shape takes its full path (no value cap) at both sizes
    small, large = (SHAPES[shape](n).encode() for n in (32 << 10, 128 << 10))
    assert 3.5 * len(small) < len(large) < 4.8 * len(small)
    assert _peak_bytes(large) < 5 * _peak_bytes(small) + MiB
    assert _cpu_seconds(large) < 10 * _cpu_seconds(small) + 0.005


@pytest.mark.parametrize("shape", SHAPES)
def test_memory_is_a_small_multiple_of_the_line(shape: str):
    line = SHAPES[shape](MiB // 2).encode()
    # the text, the parsed prompt and the entry's encoding, plus the values (capped)
    assert _peak_bytes(line) < 13 * len(line) + 25 * MiB
