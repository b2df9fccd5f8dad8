"""A tensor-parallel group's start: a rank that exits before it joins fails it at once, and
more ranks than visible GPUs are refused before any starts.

Rank 0 used to wait in gloo's rendezvous for the whole START_TIMEOUT (30 min)
on a rank that had died; now it watches the ranks it started while they join.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import timedelta

import pytest

from batchgen import Engine
from batchgen.worker.engine import GroupLost, tensor_group
from batchgen.worker.engine.tensor_group import exit_text
from batchgen.worker.engine_config import EngineConfig, InvalidEngineConfig
from tests.cli_session import Shell

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


@pytest.mark.parametrize(
    ("device", "size", "visible", "where"),
    [
        ("cuda", 4, 2, "cuda:0 to cuda:3"),
        ("cuda:1", 2, 2, "cuda:1 to cuda:2"),
        (None, 2, 0, "cuda:0 to cuda:1"),
    ],
)
def test_more_ranks_than_visible_gpus_is_refused(device, size, visible, where):
    config = EngineConfig(device=device, tensor_parallel_size=size)
    with pytest.raises(InvalidEngineConfig) as caught:
        config.check_visible_gpus(visible)
    assert str(caught.value) == (
        f"tensor_parallel_size {size} needs the GPUs {where}, but {visible} GPU(s) are visible"
    )


@pytest.mark.parametrize(("device", "size", "visible"), [("cuda", 2, 2), ("cuda:1", 2, 3)])
def test_enough_visible_gpus_pass(device, size, visible):
    EngineConfig(device=device, tensor_parallel_size=size).check_visible_gpus(visible)


def test_worker_refuses_more_ranks_than_gpus_before_any_child(tmp_path, toy_model, redis_url):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    out = Shell(tmp_path, tmp_path / "home", redis_url).run(
        "worker", "--model", "tiny", "--device", "cuda", "--tensor-parallel-size", "64"
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert re.fullmatch(
        r"batchgen: error: tensor_parallel_size 64 needs the GPUs cuda:0 to cuda:63, "
        r"but \d+ GPU\(s\) are visible\n",
        out.stderr,
    ), out.stderr


def test_a_rank_killed_while_it_loads_fails_the_first_collective_by_name(toy_model, monkeypatch):
    path = toy_model("llama")
    start = tensor_group.TensorGroup.start

    def start_then_kill(*args, **kwargs):  # joined: the rank is loading its shard now
        group = start(*args, **kwargs)
        os.kill(group.ranks[0].pid, signal.SIGKILL)
        return group

    monkeypatch.setattr(tensor_group.TensorGroup, "start", start_then_kill)
    with pytest.raises(GroupLost, match=r"^tensor-parallel group lost: rank 1 exited with -9 "
                       r"\(SIGKILL\) \(RuntimeError: "):  # fmt: skip
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)
