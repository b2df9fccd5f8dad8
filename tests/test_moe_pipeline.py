"""End to end on an MoE model with MLA (the tiny DeepSeek-V3 of the zoo): submit -> a
real worker subprocess -> Parquet, rows equal to ``Engine.generate`` on the same prompts."""

from __future__ import annotations

import json

from batchgen import Engine, SamplingParams
from tests.test_pipeline_e2e import (  # noqa: F401  (env and workers are fixtures)
    batchgen,
    download,
    env,
    mixed_lines,
    prompt_and_tokens,
    submit,
    workers,
    write_jsonl,
)


def test_deepseek_v3_job_through_a_worker_equals_the_engine(
    zoo_model,
    workers,  # noqa: F811  (the fixture imported above)
    env,  # noqa: F811
    tmp_path,
):
    model = zoo_model("deepseek_v3")
    lines = mixed_lines(24)
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "moe", tmp_path)
    proc = workers(model, "--burst", "--max-num-seqs", "8")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    status = json.loads(batchgen(env, "status", "moe", "--json").stdout)
    assert (status["state"], status["done"], status["failed"]) == ("completed", 24, 0)
    rows = download(env, "moe", tmp_path)
    assert rows["index"] == list(range(24))

    engine = Engine.from_pretrained(model, device="cpu")
    prompts, params = [], []
    for line in lines:
        prompt, max_tokens = prompt_and_tokens(line)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=max_tokens))
    expected = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert rows["token_ids"] == expected
    assert sum(len(t) for t in expected) > 24  # real generations, not empty rows
