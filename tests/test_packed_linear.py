"""CPU fp32 projections are packed for oneDNN at their first call (worker/models/weights.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.worker.models import weights
from batchgen.worker.models.weights import PACK_MIN_FLOATS, Linear, fuse, packable

pytestmark = pytest.mark.skipif(
    not packable(torch.zeros(256, 512)), reason="this torch has no oneDNN to pack with"
)


def _linear(rows_in: int = 256, out: int = 520, bias: bool = True) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out, rows_in, generator=g)  # HF's (out, in)
    b = torch.randn(out, generator=g) if bias else None
    return fuse([weight], [b]), weight


@pytest.mark.parametrize("bias", [True, False])
def test_packed_product_equals_torch_and_drops_the_dense_copy(bias: bool) -> None:
    layer, weight = _linear(bias=bias)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, weight, layer.bias)
    out = layer(x)
    assert layer.packed is not None and layer.weight.is_meta
    assert layer.weight.shape == (256, 520) and layer.out_features == 520
    # outputs ~16 in size (256 products of unit normals): fp32 sums in another order
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x), out)  # again, from the packed copy


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads() -> None:
    layer, _ = _linear()
    x = torch.randn(64, 256)
    full = layer(x)
    for rows in (1, 3, 16, 17, 63):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    assert torch.equal(layer(x[::3]), full[::3])  # rows at a stride
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(layer(x), full), n
    finally:
        torch.set_num_threads(threads)


def test_no_packing_where_onednn_is_switched_off_or_the_dtype_is_not_fp32() -> None:
    layer, weight = _linear()
    with torch.backends.mkldnn.flags(enabled=False):
        out = layer(torch.randn(4, 256))
    assert layer.packed is None and not layer.weight.is_meta and out.shape == (4, 520)
    half = Linear(weight.t().contiguous().to(torch.bfloat16))
    half(torch.randn(2, 256, dtype=torch.bfloat16))
    assert half.packed is None and half.weight.dtype == torch.bfloat16
    assert not packable(torch.zeros(256, 512, device="meta"))
    small = Linear(torch.randn(256, PACK_MIN_FLOATS // 256 - 1))  # below the size worth packing
    small(torch.randn(3, 256))
    assert small.packed is None and not small.weight.is_meta


def test_empty_input_gives_empty_output() -> None:
    layer, _ = _linear()
    assert layer(torch.randn(0, 256)).shape == (0, 520)


def test_where_onednn_refuses_to_pack_every_projection_stays_with_torch_mm(monkeypatch):
    def refuse(*args: object) -> None:
        raise RuntimeError("no primitive for this CPU")

    monkeypatch.setattr(weights, "_refused", [])
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer, _ = _linear()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    assert layer.bias is not None
    assert torch.equal(layer(x), torch.addmm(layer.bias, x, layer.weight))  # the torch.mm path
    assert layer.packed is None and not layer.weight.is_meta
    assert weights._refused == ["no primitive for this CPU"]
    assert not packable(torch.zeros(256, 512))  # the next projection does not try again
