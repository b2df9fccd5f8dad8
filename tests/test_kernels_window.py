"""Sliding windows and soft-capping in every attention path: the oracle against loops,
the CPU path (C kernel and torch) and the Triton kernels (interpreter) against the oracle.

Blocks that slid out of a row's window may already hold another sequence's
K/V: here they hold NaN, so a path that so much as reads one (a masked score
still multiplies its V) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.kernels import dense
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import decode as cpu_decode
from batchgen.kernels.cpu import native as cpu_native
from batchgen.kernels.cpu.decode_native import KernelDecode
from tests.test_kernels_cpu import attention_by_loops

WINDOW, SOFTCAP, BLOCK = 20, 3.0, 8
# the Triton kernels run compiled on a GPU, through the interpreter elsewhere
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONTEXTS = [70, 33, 21, 20, 9, 1]  # longest first; longer and shorter than the window


@pytest.mark.parametrize("window,softcap", [(WINDOW, None), (None, SOFTCAP), (7, SOFTCAP)])
def test_the_oracle_is_windowed_capped_attention_by_loops(window, softcap):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 16, generator=gen)
    k, v = torch.randn(40, 2, 16, generator=gen), torch.randn(40, 2, 16, generator=gen)
    torch.testing.assert_close(
        dense.attend(q, k, v, 0.7, window, softcap),
        attention_by_loops(q, k, v, 0.7, window, softcap),
    )


def _paged(contexts, q_lens, num_kv_heads=2, head_dim=16, window=WINDOW, seed=0):
    """K/V of each sequence in shuffled blocks; the blocks wholly before the window of
    the sequence's first query are NaN (slid out, reused), their table entries kept."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // BLOCK) for c in contexts]
    total = sum(need) + 2
    k_cache = torch.randn(total, BLOCK, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, BLOCK, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(need), dtype=torch.int32)
    dense_kv = []
    for i, (ctx, nb, q_len) in enumerate(zip(contexts, need, q_lens)):
        ids = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids)
        tables[i, nb:] = ids[-1]
        dense_kv.append((k_cache[ids].flatten(0, 1)[:ctx].clone(),
                         v_cache[ids].flatten(0, 1)[:ctx].clone()))  # fmt: skip
        first_visible = max(0, ctx - q_len - window + 1)
        for b in ids[: first_visible // BLOCK]:
            k_cache[b] = float("nan")
            v_cache[b] = float("nan")
    return k_cache, v_cache, tables, dense_kv


def _check(out, q, starts, dense_kv, scale, window, softcap, tol=1e-5):
    for i, (k, v) in enumerate(dense_kv):
        rows = slice(starts[i], starts[i + 1])
        expected = dense.attend(q[rows], k, v, scale, window, softcap)
        torch.testing.assert_close(out[rows], expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_cpu_decode_windowed_and_capped(path, softcap):
    if path == "kernel" and cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    k_cache, v_cache, tables, dense_kv = _paged(CONTEXTS, [1] * len(CONTEXTS))
    q = torch.randn(len(CONTEXTS), 4, 16)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32)
    plan = cpu_decode.plan_decode(
        tables, lens, k_cache, v_cache, path == "kernel", window=WINDOW, softcap=softcap
    )
    assert isinstance(plan, KernelDecode if path == "kernel" else cpu_decode.TorchDecode)
    out = plan(q, k_cache, v_cache, 0.4)
    _check(out, q, list(range(len(CONTEXTS) + 1)), dense_kv, 0.4, WINDOW, softcap)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_cpu_prefill_windowed_and_capped(softcap):
    contexts, q_lens = [70, 40, 21, 33], [70, 12, 5, 1]  # whole prompt, chunks, a decode row
    k_cache, v_cache, tables, dense_kv = _paged(contexts, q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 4, 16)
    out = cpu_attention.paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32), 0.4, max(q_lens), max(contexts),
        window=WINDOW, softcap=softcap,
    )  # fmt: skip
    _check(out, q, starts, dense_kv, 0.4, WINDOW, softcap)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_windowed_and_capped(softcap, num_splits):
    pytest.importorskip("triton")
    from batchgen.kernels.triton.decode_attention import decode_attention

    k_cache, v_cache, tables, dense_kv = _paged(CONTEXTS, [1] * len(CONTEXTS))
    q = torch.randn(len(CONTEXTS), 4, 16)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32)
    q_, k_, v_, tables_, lens_ = (t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens))
    out = decode_attention(
        q_, k_, v_, tables_, lens_, 0.4, max(CONTEXTS), window=WINDOW, softcap=softcap,
        num_splits=num_splits, tile_size=16,
    ).cpu()  # fmt: skip
    _check(out, q, list(range(len(CONTEXTS) + 1)), dense_kv, 0.4, WINDOW, softcap, tol=2e-5)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_triton_prefill_windowed_and_capped(softcap):
    pytest.importorskip("triton")
    from batchgen.kernels.triton.prefill_attention import prefill_attention

    contexts, q_lens = [70, 40, 21, 33], [70, 12, 5, 1]
    k_cache, v_cache, tables, dense_kv = _paged(contexts, q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], 4, 16)
    lens, locs = torch.tensor(contexts, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
    q_, k_, v_, tables_, lens_, locs_ = (
        t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens, locs)
    )
    out = prefill_attention(
        q_, k_, v_, tables_, lens_, locs_, 1 / math.sqrt(16), max(q_lens), max(contexts),
        window=WINDOW, softcap=softcap, block_m=16, tile_size=16,
    ).cpu()  # fmt: skip
    _check(out, q, starts, dense_kv, 1 / math.sqrt(16), WINDOW, softcap, tol=2e-5)
