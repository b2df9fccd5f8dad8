"""Attention sinks (gpt-oss): the oracle against transformers' own eager attention,
then the CPU path (C kernel, torch decode, prefill) and the Triton kernels
(interpreted without CUDA) against the oracle."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import dense
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import decode as cpu_decode
from batchgen.kernels.cpu import native as cpu_native
from tests.test_kernels_triton import _paged

HEADS, KV_HEADS, DIM = 6, 2, 16
SCALE = DIM**-0.5


def _sinks(seed: int = 9) -> torch.Tensor:
    # big enough that the sink takes a visible share of the weight
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2


def _q(num_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


class _Attention(torch.nn.Module):
    """What transformers' eager attention reads of gpt-oss's attention module."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.sinks = sinks


def test_the_oracle_is_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q_len, ctx = 4, 9
    q = _q(q_len)
    gen = torch.Generator().manual_seed(2)
    k, v = (
        torch.randn(ctx, KV_HEADS, DIM, generator=gen),
        torch.randn(ctx, KV_HEADS, DIM, generator=gen),
    )
    sinks = _sinks()
    visible = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
    mask = torch.zeros(1, 1, q_len, ctx).masked_fill(~visible, float("-inf"))
    module = _Attention(sinks).eval()
    hf, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask,
        SCALE,
    )
    torch.testing.assert_close(dense.attend(q, k, v, SCALE, sinks=sinks), hf[0])
    # and the sinks change the output: without them it differs
    assert not torch.allclose(dense.attend(q, k, v, SCALE), hf[0], atol=1e-3)


CONTEXTS = [1, 17, 40, 0]  # the last row is padding


def _decode_args(dtype=torch.float32):
    k_cache, v_cache, tables = _paged(CONTEXTS, KV_HEADS, DIM, 16, dtype)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=k_cache.device)
    q = _q(len(CONTEXTS)).to(k_cache.device, dtype)
    return q, k_cache, v_cache, tables, lens, SCALE, max(CONTEXTS)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_cpu_decode_with_sinks_matches_the_oracle(use_kernel):
    if use_kernel and cpu_native.load() is None:
        pytest.skip("no C compiler")
    q, k_cache, v_cache, tables, lens, scale, _ = _decode_args()
    q, k_cache, v_cache, tables, lens = (t.cpu() for t in (q, k_cache, v_cache, tables, lens))
    plan = cpu_decode.plan_decode(tables, lens, k_cache, v_cache, use_kernel)
    assert type(plan).__name__ == ("KernelDecode" if use_kernel else "TorchDecode")
    out = plan(q, k_cache, v_cache, scale, _sinks())
    expected = dense.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, 40, sinks=_sinks()
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # the padding row


def test_cpu_prefill_with_sinks_matches_the_oracle():
    contexts, q_lens = [20, 33, 17], [20, 5, 1]  # whole prompt, chunk over a cache, one token
    k_cache, v_cache, tables = (t.cpu() for t in _paged(contexts, KV_HEADS, DIM, 16))
    lens = torch.tensor(contexts, dtype=torch.int32)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = _q(sum(q_lens))
    args = (q, k_cache, v_cache, tables, lens, starts, SCALE, max(q_lens), max(contexts))
    out = cpu_attention.paged_prefill_attention(*args, sinks=_sinks())
    expected = dense.paged_prefill_attention(*args, sinks=_sinks())
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_with_sinks_matches_the_oracle(num_splits):
    pytest.importorskip("triton")
    from batchgen.kernels.triton.decode_attention import decode_attention

    q, k_cache, v_cache, tables, lens, scale, max_len = _decode_args()
    args = (q, k_cache, v_cache, tables, lens, scale, max_len)
    sinks = _sinks().to(q.device)
    out = decode_attention(*args, sinks=sinks, num_splits=num_splits)
    expected = dense.paged_decode_attention(*args, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_triton_prefill_with_sinks_matches_the_oracle_and_checks_them():
    pytest.importorskip("triton")
    from batchgen.kernels.triton.prefill_attention import prefill_attention

    contexts, q_lens = [20, 33, 17], [20, 5, 1]
    k_cache, v_cache, tables = _paged(contexts, KV_HEADS, DIM, 16)
    device = k_cache.device
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    q = _q(sum(q_lens)).to(device)
    args = (q, k_cache, v_cache, tables, lens, starts, SCALE, max(q_lens), max(contexts))
    sinks = _sinks().to(device)
    out = prefill_attention(*args, sinks=sinks, block_m=16, tile_size=16)
    expected = dense.paged_prefill_attention(*args, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="sinks must have shape"):
        prefill_attention(*args, sinks=sinks[:2])
