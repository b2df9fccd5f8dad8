"""The KV pool's size on CUDA: the device's share less what is in use, read once
PyTorch has handed back the memory it caches."""

from __future__ import annotations

import pytest
import torch

from batchgen.worker.engine.runner.kv_cache import (
    STEP_MARGIN_BYTES,
    cuda_kv_budget,
    kv_budget,
)

GIB = 1 << 30


def test_the_kv_budget_is_the_used_share_less_what_is_in_use_and_a_margin():
    # 80 GiB device, 0.9 of it ours to fill, 20 GiB in use (weights, context, others)
    assert kv_budget(80 * GIB, 60 * GIB, 0.9) == 72 * GIB - 20 * GIB - STEP_MARGIN_BYTES
    assert kv_budget(80 * GIB, 10 * GIB, 0.9) == 0  # more in use than the share: none, not < 0
    assert kv_budget(80 * GIB, 80 * GIB, 1.0) == 80 * GIB - STEP_MARGIN_BYTES


def test_the_cuda_budget_is_read_after_the_cache_is_emptied(monkeypatch):
    # no GPU here: torch.cuda's two calls recorded, in order (the GPU test reads a real one)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device):
        calls.append("mem_get_info")
        return 60 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert cuda_kv_budget(torch.device("cuda"), 0.9) == kv_budget(80 * GIB, 60 * GIB, 0.9)
    assert calls == ["empty_cache", "mem_get_info"]


@pytest.mark.gpu
def test_memory_pytorch_cached_after_loading_goes_to_the_kv_pool():
    device = torch.device("cuda")
    scratch = torch.empty(GIB, dtype=torch.uint8, device=device)
    del scratch  # freed to PyTorch's cache, not to the device
    free, total = torch.cuda.mem_get_info(device)
    before = kv_budget(total, free, 0.9)
    assert cuda_kv_budget(device, 0.9) >= before + GIB - (64 << 20)
