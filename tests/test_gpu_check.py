"""benchmarks/gpu_check.py runs as a plain script; its dry run (CPU, Triton
interpreter, tiny shapes) checks the structure the GPU run will print."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_dry_run_reports_every_section_as_json(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    out_file = tmp_path / "result.json"
    sections = "correctness,bandwidth"  # the engine section has a test of its own
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--sections", sections, "--out", str(out_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert json.loads(out_file.read_text()) == result
    assert result["mode"] == "dry-run"
    assert result["env"]["batchgen"] == str(REPO / "batchgen")

    correctness = result["sections"]["correctness"]
    assert correctness["all_pass"] is True, correctness
    assert {"store_kv", "decode", "decode_8_splits", "prefill", "norms", "apply_rotary"} <= set(
        correctness
    )
    assert correctness["store_kv"]["max_abs_err"] == 0.0

    bandwidth = result["sections"]["bandwidth"]
    assert bandwidth["copy_gb_per_s"] > 0
    assert [(r["batch"], r["context"]) for r in bandwidth["decode"]] == [(2, 17), (2, 40)]
    assert all(r["ms"] > 0 and r["fraction_of_copy"] > 0 for r in bandwidth["decode"])
    assert len(bandwidth["target_shape_sweep"]) == 9  # 3 tiles x 2 warp counts, 3 splits
    assert isinstance(bandwidth["target_met"], bool)
    assert "decode" in proc.stderr and "copy bandwidth" in proc.stderr  # the table


def test_dry_run_engine_section_runs_batchgen_and_hf_on_the_same_prompts(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--sections", "engine"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    section = json.loads(proc.stdout)["sections"]["engine"]
    assert "error" not in section, section
    ours, hf = section["engine"], section["hf_continuous_batching"]
    # 4 prompts x 4 new tokens each, EOS ignored, on both sides
    assert ours["output_tokens"] == hf["output_tokens"] == 16
    assert ours["requests"] == hf["requests"] == 4 and hf["errors"] == []
    assert ours["ops"] == "cpu" and ours["cuda_graphs"] is False  # CPU dry run
    assert ours["cuda_graph_replays"] == 0 and ours["steps"] > 0
    assert section["speedup"] == ours["output_tok_s"] / hf["output_tok_s"]
    assert f"CUDA-graph replays 0 of {ours['steps']} steps" in proc.stderr


def test_dry_run_moe_section_checks_the_fused_kernel_against_the_oracle(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--sections", "moe"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    section = json.loads(proc.stdout)["sections"]["moe"]
    assert section["all_pass"] is True, section
    for name in ("tiny", "tiny_gpt_oss"):
        case = section[name]
        assert set(case["checks"]) == {"tokens_3", "tokens_20"}
        assert all(0 < c["relative_error"] < 3e-2 for c in case["checks"].values())
        assert [t["tokens"] for t in case["timing"]] == [1, 5]
        assert all(t["fused_ms"] > 0 and t["grouped_torch_ms"] > 0 for t in case["timing"])
        assert all(1 <= t["experts_chosen"] <= 4 for t in case["timing"])
    assert "moe tiny_gpt_oss" in proc.stderr and "fused" in proc.stderr  # the table


def test_a_failing_section_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look it up
    spec.loader.exec_module(gpu_check)

    def broken(bench):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(
        gpu_check, "SECTIONS", {"broken": broken, "fine": lambda bench: {"ok": True}}
    )
    result = gpu_check.main(["--dry-run", "--sections", "broken,fine"])
    assert result["sections"]["broken"]["error"] == "RuntimeError('kernel exploded')"
    assert "kernel exploded" in result["sections"]["broken"]["traceback"]
    assert result["sections"]["fine"]["ok"] is True
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))


@pytest.mark.gpu
def test_gpu_check_correctness_on_the_device():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sections", "correctness"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sections"]["correctness"]["all_pass"] is True
