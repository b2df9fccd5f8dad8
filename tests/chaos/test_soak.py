"""The soak (benchmarks/soak.py) as a test, one fixed seed: three jobs at once (one
cancelled midway, one whose output breaks for 15 s, one plain), engine processes
SIGKILLed at random, Redis killed and restarted, one finalize killed."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.soak import SoakConfig, run_soak, table

SEED = 1


@pytest.mark.slow
def test_a_seeded_storm_of_faults_loses_duplicates_and_leaves_nothing(model, reference, tmp_path):
    # four sequences a worker: rows come in small steps, so the storm, which acts on
    # progress, finds several moments to kill however fast the machine runs the model
    config = SoakConfig(seed=SEED, requests=100, max_num_seqs=4, timeout_s=420)
    result = run_soak(config, model, tmp_path,
                      reference=lambda lines: reference(lines).token_ids)  # fmt: skip
    print(table([result]))
    print(json.dumps(asdict(result)))
    assert result.ok, result.problems
    assert (result.rows, result.error_rows, result.lost, result.duplicated) == (300, 0, 0, 0)
    assert (result.late_cancelled_rows, result.orphan_files, result.keys_left) == (0, 0, 0)
    assert 0 < result.cancelled_at < config.requests  # the cancel landed midway
    assert result.kills >= 3 and result.restarts >= result.kills
    assert (result.redis_restarts, result.finalize_kills) == (1, 1)
    assert result.broken_s >= 15.0 and result.pending_at_end == 0
