"""``quantization="int8"`` / ``--quantization int8``: an unquantized checkpoint made W8A8 int8
at load (int8 weights with a scale per output channel, each token's input quantized to int8
with its own scale, the product int8 x int8 in int32 through ``torch._int_mm``).

The weights are int8 in memory and every decoder projection runs the integer
product (counted); they equal, byte for byte, the compressed-tensors library's
W8A8 quantization of the same checkpoint; each projection's output equals, bit
for bit, the same math written here in plain torch from the original weights,
and the greedy tokens equal those of transformers' model running that math.
Not exact against the unquantized model, so its error is measured and bounded
as tests/test_online_fp8.py does for FP8 (which also runs ``batchgen run`` and a worker with
``--quantization int8``). CUDA, which has no int8 product, refuses it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from batchgen import Engine, SamplingParams
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.worker_errors import InvalidEngineConfig
from tests.family_parity import random_prompts
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import compress
from tests.test_online_fp8 import SETTINGS, as_compressed_tensors_writes_them, held_quantized
from tests.test_quantized_models import _projections, _reference_greedy

# the engine's fused projections, by the checkpoint's module names (of layer i)
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # fmt: skip


def _rows_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``t`` as symmetric int8: scale max|row| / 127.5 (compressed-tensors'
    range 255 / 2; eps for a row of zeros), values round(clamp(t / scale, -128, 127))."""
    scale = t.abs().amax(dim=-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(t.dtype).eps, scale)
    return torch.round(torch.clamp(t / scale, -128, 127)), scale


def w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (rows, K) fp32 by weight (N, K) fp32, in plain torch: both rounded to int8 per row,
    the integer sums exact (int64), scaled by the token's and then the channel's scale."""
    qx, sx = _rows_int8(x)
    qw, sw = _rows_int8(weight)
    sums = qx.long() @ qw.long().t()
    out = sums.float() * sx * sw.reshape(-1)
    return out if bias is None else out + bias


def test_weights_are_int8_and_the_product_is_integer(
    zoo_model, tmp_path: Path, monkeypatch
) -> None:
    plain_path = zoo_model("llama")
    int8, plain, parts = held_quantized(plain_path, "int8", torch.int8)
    # every projection multiplies the stored int8 weights themselves (no copy) in int32
    projections = _projections(int8)
    for p in projections:
        assert p.int8 is not None  # type: ignore[attr-defined]
        stored = [q.values.data_ptr() for q in p.parts]  # type: ignore[attr-defined]
        assert [w.data_ptr() for w, _ in p.int8] == stored  # type: ignore[attr-defined]
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    int_mm = torch._int_mm

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.dtype, b.dtype))
        return int_mm(a, b)

    monkeypatch.setattr(torch, "_int_mm", counting)
    steps = int8.stats().num_steps
    int8.generate(random_prompts(VOCAB, (5, 30), seed=3), SamplingParams(max_tokens=4))
    steps = int8.stats().num_steps - steps
    assert steps > 0 and len(calls) == 14 * steps  # 7 int8 products a layer, every step
    assert set(calls) == {(torch.int8, torch.int8)}
    monkeypatch.undo()

    # the compressed-tensors library's W8A8 int8 quantization of the same weights
    ct_path = compress(plain_path, tmp_path / "ct", "w8a8-int8")
    as_compressed_tensors_writes_them(int8, plain, parts, ct_path)


def _reference(path: Path) -> Any:
    """transformers' model of the unquantized checkpoint, each decoder projection running
    ``w8a8_reference`` on its own fp32 weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")  # fmt: skip
    model.eval()
    names = {n.rsplit(".", 1)[-1] for group in FUSED for n in group}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names:

            def forward(x: torch.Tensor, m: torch.nn.Linear = module) -> torch.Tensor:
                rows = x.reshape(-1, x.shape[-1])
                return w8a8_reference(rows, m.weight, m.bias).reshape(*x.shape[:-1], -1)

            module.forward = forward  # type: ignore[method-assign, assignment]
    return model


def test_exact_against_plain_torch(zoo_model) -> None:
    path = zoo_model("llama")
    engine = Engine.from_pretrained(path, quantization="int8", **SETTINGS)
    reference = _reference(path)
    layers = reference.model.layers
    # each projection, bit for bit, on inputs of 1 to 9 rows
    torch.manual_seed(0)
    for i, layer in enumerate(engine.runner.model.weights.layers):  # type: ignore[attr-defined]
        ours = (layer.attention.qkv, layer.attention.o, layer.mlp.up, layer.mlp.down)
        for p, names in zip(ours, FUSED, strict=True):
            modules = [layers[i].get_submodule(n) for n in names]
            for rows in (1, 9):
                x = torch.randn(rows, modules[0].in_features) * 2
                expected = torch.cat([w8a8_reference(x, m.weight, m.bias) for m in modules], 1)
                assert torch.equal(p(x), expected), (i, names, rows)
    # end to end: the greedy tokens of transformers' model running the same math
    prompts = random_prompts(VOCAB, (1, 6, 17, 40), seed=12)
    got = [
        o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ]
    assert got == [_reference_greedy(reference, prompt, 8) for prompt in prompts]
    assert len({tuple(o) for o in got}) > 1


ON_CUDA = (
    "quantization int8 runs on the CPU only (int8 x int8 products through torch._int_mm); "
    "batchgen has no CUDA int8 product yet: run it with --device cpu, or use --quantization "
    "fp8 or no --quantization on the GPU"
)


def test_refusals(zoo_model, tmp_path: Path, monkeypatch) -> None:
    on_cuda = f"^{re.escape(ON_CUDA)}$"
    for device in ("cuda", "cuda:1"):  # asked for: refused with the settings
        with pytest.raises(InvalidEngineConfig, match=on_cuda):
            EngineConfig(device=device, quantization="int8")
    EngineConfig(device="cpu", quantization="int8")
    EngineConfig(device="cuda", quantization="fp8")  # fp8 runs its dequantizing product there
    # CUDA by default where there is one: refused once the device is known, before anything
    # is placed on it (no GPU here: its presence is pretended)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(InvalidEngineConfig, match=on_cuda):
        Engine.from_pretrained(zoo_model("llama"), quantization="int8")
    monkeypatch.undo()
    stored = compress(zoo_model("llama"), tmp_path / "w8a8", "w8a8-int8")
    with pytest.raises(
        UnsupportedModelError, match=r"already quantized \(quant_method compressed-tensors\)"
    ):
        Engine.from_pretrained(stored, quantization="int8")
    with pytest.raises(
        UnsupportedModelError,
        match=r"^online int8 quantization is not supported "
        r"for a family whose projections are reordered or transposed at load$",
    ):
        Engine.from_pretrained(zoo_model("gpt2"), quantization="int8", num_kv_blocks=8)


def test_cli_refuses_int8_on_cuda(tmp_path: Path) -> None:
    """One line and exit 2, before any model, queue or Redis is touched."""
    from batchgen.cli import main

    result = CliRunner().invoke(main, ["run", "p.jsonl", "-o", str(tmp_path / "x.pq"), "--model",
                                       str(tmp_path), "--device", "cuda", "--quantization", "int8"])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"batchgen: error: {ON_CUDA}"]
