"""The transformers backend through the pipeline: ``batchgen run`` and ``batchgen worker``
with ``--model-impl``, rows equal to ``Engine.generate`` on the same prompts."""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq

from batchgen import Engine, SamplingParams
from tests.releases import needs_backend
from tests.test_pipeline_e2e import batchgen, download, submit, write_jsonl
from tests.test_pipeline_e2e import env as env  # fixtures
from tests.test_pipeline_e2e import workers as workers

pytestmark = needs_backend

LINES: list[dict[str, Any]] = [{"prompt": f"Line {i}: tell me about item {i * 7 % 13}.", "max_tokens": 4 + i % 5}
         for i in range(8)]  # fmt: skip


def _reference(model) -> list[list[int]]:
    engine = Engine.from_pretrained(model, device="cpu")
    params = [SamplingParams(max_tokens=line["max_tokens"]) for line in LINES]
    return [o.token_ids for o in engine.generate([line["prompt"] for line in LINES], params)]


def test_run_and_worker_take_model_impl(zoo_model, env, workers, tmp_path):
    model = zoo_model("gptj")
    expected = _reference(model)
    prompts = write_jsonl(tmp_path / "p.jsonl", LINES)
    # auto: no native family matches, so the backend runs it
    out = batchgen(env, "run", str(prompts), "--model", str(model), "-o", str(tmp_path / "r.parquet"),
                   "--device", "cpu", "--job-output", str(tmp_path / "run-job"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert pq.read_table(tmp_path / "r.parquet").to_pydict()["token_ids"] == expected

    refused = batchgen(env, "run", str(prompts), "--model", str(model), "-o",
                       str(tmp_path / "n.parquet"), "--device", "cpu", "--model-impl", "native",
                       "--job-output", str(tmp_path / "native-job"))  # fmt: skip
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    assert "architecture GPTJForCausalLM" in line and "is not supported" in line

    submit(env, model, prompts, "w", tmp_path)
    proc = workers(model, "--burst", "--model-impl", "transformers")
    assert proc.wait(timeout=300) == 0
    assert download(env, "w", tmp_path)["token_ids"] == expected
