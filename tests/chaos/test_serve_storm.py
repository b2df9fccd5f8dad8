"""The serve storm (benchmarks/serve_storm.py) as a test, one fixed seed: servers frozen
mid-validation and mid-output and kill -9'ed, inputs deleted and batches cancelled mid-run;
every batch ends completed, failed or cancelled with one line per request."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.serve_storm import StormConfig, run_storm, table

SEED = 1


@pytest.mark.slow
def test_a_seeded_storm_over_serve_leaves_every_batch_whole(model, tmp_path):
    config = StormConfig(seed=SEED)
    result = run_storm(config, model, tmp_path)
    print(table([result]))
    print(json.dumps(asdict(result)))
    assert result.ok, result.problems
    assert result.killed_validating + result.killed_writing + result.not_reached == config.kills
    assert result.killed_validating >= 1 and result.killed_writing >= 1
    assert result.batches >= config.batches and result.deleted_inputs + result.cancels >= 1
    assert result.completed + result.cancelled + result.failed == result.batches
    assert result.lines == result.requests
