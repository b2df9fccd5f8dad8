"""A fused projection's quantized parts joined along the outputs (worker/models/quant/fused_parts.py):
the joined weight dequantizes to the parts side by side, bit for bit; parts whose layouts do
not join stay apart with a GEMM each; a tensor-parallel cut of a joined projection keeps each
module's run and joins them again. Tiny random tensors in each format's stored layout; the
GEMMs are never called here (tests/test_quant_triton_path.py runs them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from batchgen.kernels.ops import QuantGemms
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear, QuantizedWeight
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight, WeightArgs
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.fused_parts import join_outputs
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.quant.sharding import column_shard

K = 64


def _never(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("no GEMM runs here")


GEMMS = QuantGemms(fp8_block=_never, gptq=_never, awq=_never, pack_quantized=_never)


def _words(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _scales(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 0.1 + 0.01).half()


def gptq(n: int, seed: int = 0, group: int = 32, order: torch.Tensor | None = None) -> GptqWeight:
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[torch.arange(K) if order is None else order] = torch.arange(K, dtype=torch.int32) // group
    groups = K // group
    return GptqWeight(_words(K // 8, n, seed=seed), _words(groups, math.ceil(n / 8), seed=seed + 1),
                      _scales(groups, n, seed=seed + 2), g_idx, 4, 1)  # fmt: skip


def awq(n: int, seed: int = 0, group: int = 32) -> AwqWeight:
    return AwqWeight(_words(K, n // 8, seed=seed), _words(K // group, n // 8, seed=seed + 1),
                     _scales(K // group, n, seed=seed + 2), group)  # fmt: skip


def packed(n: int, seed: int = 0, group: int = 32, symmetric: bool = False) -> CompressedWeight:
    zero = None if symmetric else _words(math.ceil(n / 8), K // group, seed=seed + 1)
    args = WeightArgs("int", 4, symmetric, group)
    return CompressedWeight(_words(n, K // 8, seed=seed), _scales(n, K // group, seed=seed + 2),
                            zero, args, (n, K), packed=True)  # fmt: skip


def fp8(n: int, seed: int = 0, block: tuple[int, int] = (32, 32)) -> Fp8BlockWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, K, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (math.ceil(n / block[0]), math.ceil(K / block[1]))
    return Fp8BlockWeight(weight, torch.rand(grid, generator=gen) * 0.01, block)


def _linear(parts: tuple[QuantizedWeight, ...], gemms: QuantGemms | None) -> QuantizedLinear:
    shape = torch.empty(K, sum(p.out_features for p in parts), device="meta")
    names = tuple(f"l.{name}_proj" for name in "qkv"[: len(parts)])
    return QuantizedLinear(shape, None, decided=True, parts=parts, names=names, gemms=gemms)


def _same(got: tuple[QuantizedWeight, ...], parts: tuple[QuantizedWeight, ...]) -> bool:
    return len(got) == len(parts) and all(a is b for a, b in zip(got, parts, strict=True))


Parts = Callable[[], tuple[QuantizedWeight, ...]]
# q/k/v widths 64, 32, 32; the last part may end inside its last word or block
JOINED: dict[str, Parts] = {
    "gptq": lambda: (gptq(64, 0), gptq(32, 10), gptq(32, 20)),
    "gptq-act-order": lambda: tuple(
        gptq(n, seed, order=torch.arange(K).flip(0)) for n, seed in ((64, 0), (32, 10), (32, 20))
    ),
    "awq": lambda: (awq(64, 0), awq(32, 10), awq(32, 20)),
    "pack-quantized": lambda: (packed(64, 0), packed(32, 10), packed(12, 20)),
    "pack-quantized-symmetric": lambda: (
        packed(64, 0, symmetric=True),
        packed(36, 10, symmetric=True),
    ),
    "fp8-block": lambda: (fp8(64, 0), fp8(32, 10), fp8(20, 20)),
    # one scale per tensor: each part is one block of its own height; equal heights join
    "fp8-per-tensor": lambda: (fp8(32, 0, block=(32, K)), fp8(32, 10, block=(32, K))),
}


@pytest.mark.parametrize("kind", list(JOINED))
def test_joined_parts_are_the_parts_side_by_side(kind: str) -> None:
    parts = JOINED[kind]()
    joined = join_outputs(parts)
    assert type(joined) is type(parts[0]) and joined is not None
    assert joined.out_features == sum(p.out_features for p in parts)
    whole = torch.cat([p.dequantize(0, p.out_features) for p in parts])
    assert torch.equal(joined.dequantize(0, joined.out_features), whole)
    layer = _linear(parts, GEMMS)  # on the Triton ops: one part, one GEMM
    assert len(layer.parts) == 1 and len(layer.kernels or ()) == 1
    assert torch.equal(layer.dequantized(), whole.t())
    cpu = _linear(parts, None)  # the CPU path keeps the checkpoint's parts
    assert _same(cpu.parts, parts) and cpu.kernels is None


APART: dict[str, Parts] = {
    # act-order: each part's own permutation of its groups
    "gptq-g_idx": lambda: (gptq(64), gptq(32, 10, order=torch.arange(K).flip(0))),
    "gptq-groups": lambda: (gptq(64, group=32), gptq(32, 10, group=64)),
    "gptq-word": lambda: (gptq(4), gptq(32, 10)),  # 4 outputs: half a word of zero points
    "awq-groups": lambda: (awq(64, group=32), awq(32, 10, group=16)),
    "pack-quantized-groups": lambda: (packed(64, group=32), packed(32, 10, group=16)),
    "pack-quantized-word": lambda: (packed(12), packed(32, 10)),  # zero points: 1.5 words
    "pack-quantized-symmetry": lambda: (packed(64), packed(32, 10, symmetric=True)),
    "fp8-block-cut": lambda: (fp8(48), fp8(32, 10)),  # 48 rows: 1.5 blocks of 32
    "fp8-blocks": lambda: (fp8(64), fp8(64, 10, block=(64, 32))),
    "fp8-per-tensor": lambda: (fp8(64, block=(64, K)), fp8(32, 10, block=(32, K))),
    "formats": lambda: (gptq(64), awq(64)),
}


@pytest.mark.parametrize("kind", list(APART))
def test_parts_that_cannot_join_keep_a_gemm_each(kind: str) -> None:
    parts = APART[kind]()
    assert join_outputs(parts) is None
    if all(p.kernel(GEMMS) is not None for p in parts):
        layer = _linear(parts, GEMMS)
        assert _same(layer.parts, parts) and len(layer.kernels or ()) == len(parts)


def _rank(rank: int) -> torch.Tensor:
    """Rank ``rank`` of 2's columns of q/k/v (64, 32, 32 wide: 4 and 2 heads of 16)."""
    q, k = torch.arange(32 * rank, 32 * rank + 32), torch.arange(16 * rank, 16 * rank + 16)
    return torch.cat((q, 64 + k, 96 + k))


def test_a_tensor_parallel_cut_of_a_joined_projection_joins_its_runs() -> None:
    parts = (gptq(64, 0), gptq(32, 10), gptq(32, 20))
    joined, apart = _linear(parts, GEMMS), _linear(parts, None)
    assert len(joined.parts) == 1 and len(apart.parts) == 3
    for rank in range(2):
        index = _rank(rank)
        expected = apart.dequantized()[:, index]
        shard = column_shard(joined, index)  # three runs of one part, joined again
        assert len(shard.parts) == 1 and len(shard.kernels or ()) == 1
        assert torch.equal(shard.dequantized(), expected)
        per_part = column_shard(apart, index)  # the CPU path: a run of each part
        assert [p.out_features for p in per_part.parts] == [32, 16, 16]
        assert torch.equal(per_part.dequantized(), expected)
    with pytest.raises(UnsupportedModelError, match=r"cut l\.q_proj \+ l\.k_proj \+ l\.v_proj "
                       r"\(GptqWeight\) at output features \[68, 96\) of 128, inside its int32 "
                       r"words of 8"):  # fmt: skip
        column_shard(joined, torch.arange(68, 96))
