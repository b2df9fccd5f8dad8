"""The engine's CPU threads follow the CPUs the process may use: its affinity mask
and its cgroup's quota (fake cgroup folders here), never the host's core count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen import openmp_waits
from batchgen.worker import cpu_threads
from batchgen.worker.cpu_threads import choose_threads, cpu_quota, usable_cpus


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup tree (path -> content under it) and a /proc/self/cgroup naming it."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self").write_text(membership)
    return root, tmp_path / "self"


@pytest.mark.parametrize(
    "membership,files,cpus",
    [
        ("0::/\n", {}, 6),  # no quota: the affinity mask
        ("0::/\n", {"cpu.max": "max 100000\n"}, 6),
        ("0::/\n", {"cpu.max": "250000 100000\n"}, 2),  # 2.5 CPUs: rounded down
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one thread
        # the tightest of the process's cgroup and its ancestors
        ("0::/a/b\n", {"a/cpu.max": "300000 100000", "a/b/cpu.max": "max 100000"}, 3),
        ("0::/a/b\n", {"a/cpu.max": "max 100000", "a/b/cpu.max": "400000 100000"}, 4),
        # v1: the cpu controller's mount; a path the container does not see (docker)
        ("4:cpu,cpuacct:/docker/f00\n1:memory:/docker/f00\n",
         {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
         2),
        ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                               "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 6),
        ("1:memory:/x\n", {"memory/cpu.cfs_quota_us": "100000\n"}, 6),  # not the cpu controller
    ],
)  # fmt: skip
def test_usable_cpus_are_the_affinity_mask_within_the_cgroup_quota(
    tmp_path, membership, files, cpus
):
    root, self_cgroup = _cgroup(tmp_path, membership, files)
    assert usable_cpus(range(6), root, self_cgroup) == cpus
    assert usable_cpus(range(1), root, self_cgroup) == 1  # a mask of one CPU whatever the quota


def test_an_unreadable_cgroup_sets_no_quota(tmp_path):
    assert cpu_quota(tmp_path, tmp_path / "missing") is None
    root, self_cgroup = _cgroup(tmp_path, "0::/\n", {"cpu.max": "garbage\n"})
    assert cpu_quota(root, self_cgroup) is None


def test_the_thread_count_asked_for_wins_else_the_fewer_of_torchs_and_the_usable_cpus():
    assert choose_threads(None, current=8, usable=3) == 3  # torch's default counts host cores
    assert choose_threads(None, current=1, usable=4) == 1  # OMP_NUM_THREADS=1 or set by the caller
    assert choose_threads(5, current=1, usable=2) == 5  # EngineConfig checked it is >= 1


def test_the_engine_takes_its_thread_count_from_the_mask_and_quota_it_is_given(
    toy_model, tmp_path, monkeypatch
):
    from batchgen import Engine
    from batchgen.worker.engine.runner.loading import set_threads

    root, self_cgroup = _cgroup(tmp_path, "0::/pod\n", {"pod/cpu.max": "300000 100000\n"})
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_threads, "SELF_CGROUP", self_cgroup)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)  # as torch's default on an 8-core host
        engine = Engine.from_pretrained(toy_model(), device="cpu", num_kv_blocks=16)
        assert (engine.limits.threads, torch.get_num_threads()) == (3, 3)  # the quota
        torch.set_num_threads(8)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5})
        assert (set_threads(None, torch.device("cpu")), torch.get_num_threads()) == (2, 2)  # mask
        # two tensor-parallel ranks share the two CPUs
        assert (set_threads(None, torch.device("cpu"), 2), torch.get_num_threads()) == (1, 1)
        torch.set_num_threads(8)
        assert (set_threads(5, torch.device("cpu")), torch.get_num_threads()) == (5, 5)  # asked
        # CUDA keeps torch's own count unless asked
        assert (set_threads(None, torch.device("cuda")), torch.get_num_threads()) == (5, 5)
    finally:
        torch.set_num_threads(before)


def test_importing_batchgen_before_torch_makes_openmp_spin_briefly():
    """OpenMP reads its wait policy once, when torch loads it: batchgen sets it first,
    leaves a policy the user set alone, and knows when it came too late."""
    code = (
        "import os, sys\n"
        "if sys.argv[1] == 'torch': import torch\n"
        "import batchgen\n"
        "from batchgen import openmp_waits as t\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),\n"
        "      t.wait_policy_missed())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in openmp_waits.WAIT_VARIABLES}

    def run(order: str, **extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, order], env={**env, **extra},
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()

    assert run("batchgen") == "None 10000 False"
    assert run("torch") == "None None True"
    assert run("torch", GOMP_SPINCOUNT="1000") == "None 1000 False"
    assert run("batchgen", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None False"
