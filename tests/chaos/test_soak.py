"""The soak (benchmarks/soak.py) as a test: 2,000 requests, three CPU workers, one
SIGKILLed every 3 s and restarted, Redis killed and restarted once."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.soak import SoakConfig, run_soak, table


@pytest.mark.slow
def test_soak_with_workers_and_redis_killed_loses_and_duplicates_nothing(
    model, reference, tmp_path
):
    config = SoakConfig(timeout_s=480)  # under pytest-timeout's 600 s: a clean report
    result, rows = run_soak(
        config, model, tmp_path, reference=lambda lines: reference(lines).token_ids
    )
    print(table(result))
    print(json.dumps(asdict(result)))
    assert result.ok, result.problems  # N rows, ids once, done + failed = N, PEL empty, ...
    assert (result.rows, result.done + result.failed) == (2000, 2000)
    assert (result.lost, result.duplicated, result.pending_at_end) == (0, 0, 0)
    assert result.kills >= 5 and result.restarts >= result.kills
    assert result.redis_restarts == 1
    assert rows["id"] == [f"soak-{i}" for i in range(2000)]
