"""benchmarks/engine_bench.py's batchgen rows at a precision of their own: ``batchgen:int8``
runs batchgen's ``quantization="int8"`` on ``--dtype``'s floats (as ``ct2:int8`` and
``llama.cpp:q8_0`` name their engines' own int8), labelled int8 in the table."""

from __future__ import annotations

from batchgen import Engine, SamplingParams
from benchmarks.engine_bench import agreement, run_child
from benchmarks.workloads import WORKLOADS


def test_batchgen_int8_row_is_the_int8_engine(toy_model) -> None:
    model = toy_model("llama")
    n, vocab = 3, 8192
    rows = {
        peer: run_child(model, peer, "mixed", n, vocab, "float32", threads=1)
        for peer in ("batchgen", "batchgen:int8")
    }
    assert (rows["batchgen"]["dtype"], rows["batchgen:int8"]["dtype"]) == ("float32", "int8")
    # the same workload on this process's engine, quantized at load: the same tokens
    wl = WORKLOADS["mixed"](n, vocab)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    engine = Engine.from_pretrained(model, dtype="float32", threads=1, quantization="int8")
    expected = [o.token_ids for o in engine.generate(wl.prompts, params)]
    assert rows["batchgen:int8"]["token_ids"] == expected
    # and not fp32's: its agreement with batchgen fp32 is measured, below 1
    fp32 = rows["batchgen"]["token_ids"]
    assert agreement(expected, fp32)["token_agreement"] < 1.0
    assert agreement(fp32, fp32) == {"requests_identical": "3/3", "token_agreement": 1.0}
