"""A tensor-parallel group's start: a rank that exits before it joins fails it at once.

Rank 0 used to wait in gloo's rendezvous for the whole START_TIMEOUT (30 min)
on a rank that had died; now it watches the ranks it started while they join.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest

from batchgen import Engine
from batchgen.worker.engine import GroupLost, tensor_group
from batchgen.worker.engine.tensor_group import exit_text

SETTINGS = dict(num_kv_blocks=96, threads=1, max_num_batched_tokens=48)


def test_a_rank_killed_before_it_joins_fails_the_start_at_once(toy_model, monkeypatch):
    # bounds the test should the watch be broken: gloo then waits this long, not 30 min
    monkeypatch.setattr(tensor_group, "START_TIMEOUT", timedelta(seconds=20))
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def start_then_kill(*args, **kwargs):  # the real rank process, killed by its pid
        proc = popen(*args, **kwargs)
        os.kill(proc.pid, signal.SIGKILL)
        started.append(proc)
        return proc

    path = toy_model("llama")  # built before the clock starts
    monkeypatch.setattr(subprocess, "Popen", start_then_kill)
    began = time.monotonic()
    with pytest.raises(GroupLost) as caught:
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)
    took = time.monotonic() - began
    assert str(caught.value) == (
        "tensor-parallel group lost: rank 1 exited with -9 (SIGKILL) before it joined"
    )
    assert took < 5, took
    assert [p.returncode for p in started] == [-9]


def test_a_rank_exit_names_its_signal():
    assert exit_text(-9) == "exited with -9 (SIGKILL)"
    assert exit_text(-15) == "exited with -15 (SIGTERM)"
    assert exit_text(1) == "exited with 1"
