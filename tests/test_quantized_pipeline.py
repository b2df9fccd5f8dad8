"""End to end on quantized checkpoints, one FP8 (block-wise, DeepSeek-V3's layout) and one
int4 (compressed-tensors W4A16): submit -> a real worker subprocess -> Parquet, rows
equal to ``Engine.generate`` on the same prompts (which equals transformers'
dequantized model: test_quantized_models.py)."""

from __future__ import annotations

import json

import pytest

from batchgen import Engine, SamplingParams
from tests.quant_checkpoints import compress, quantize_fp8_block
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


@pytest.mark.parametrize("kind", ["fp8", "w4a16"])
def test_quantized_job_through_a_worker_equals_the_engine(
    zoo_model,
    workers,  # noqa: F811  (the fixture imported above)
    env,  # noqa: F811
    tmp_path,
    kind,
):
    if kind == "fp8":
        model = quantize_fp8_block(zoo_model("llama"), tmp_path / "model", (32, 32))
    else:
        model = compress(zoo_model("llama"), tmp_path / "model", "w4a16")
    lines = mixed_lines(16)
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "quant", tmp_path)
    proc = workers(model, "--burst", "--max-num-seqs", "8")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    status = json.loads(batchgen(env, "status", "quant", "--json").stdout)
    assert (status["state"], status["done"], status["failed"]) == ("completed", 16, 0)
    rows = download(env, "quant", tmp_path)
    assert rows["index"] == list(range(16))

    engine = Engine.from_pretrained(model, device="cpu")
    prompts, params = [], []
    for line in lines:
        prompt, max_tokens = prompt_and_tokens(line)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=max_tokens))
    expected = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert rows["token_ids"] == expected
    assert sum(len(t) for t in expected) > 16  # real generations, not empty rows
