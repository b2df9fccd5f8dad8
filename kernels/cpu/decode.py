"""The CPU path's paged decode attention: one query token per sequence.

Same signature as the Triton kernel and the oracle (``dense.py``), which its
tests compare it with; layouts are those of ``reference.py``. How to go about
a step's decode rows is the same for every layer, so ``plan_decode`` decides
once per step and every layer calls the plan:

- fp32 or bf16 caches in the engine's layout: the C kernel
  (``decode_native.py``), which reads each sequence's K/V once, straight
  from its blocks (bf16 widened as read, its sums in fp32);
- otherwise (no C compiler, other dtypes) torch: each row's blocks gathered
  into a dense tensor and SDPA over it, rows of similar length together (the
  scheduler orders decodes longest first), so short rows are not padded to
  the longest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels.cpu.decode_native import KernelDecode, plan_kernel_decode
from batchgen.kernels.cpu.sinks import attention_with_sinks


@dataclass(slots=True)
class _Group:
    """Rows [start, end) padded to one length; their gathered K/V is (rows, length, Hk, D)."""

    start: int
    end: int
    gather: torch.Tensor  # (rows * num_blocks,) int64 block ids
    mask: torch.Tensor | None  # (rows, 1, 1, length) additive; None: nothing hidden


@dataclass(slots=True)
class TorchDecode:
    groups: list[_Group]
    empty_rows: torch.Tensor | None  # (num_seqs,) bool: context 0, output zeros
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer: q (num_seqs, num_heads, head_dim) -> (num_seqs, num_heads, head_dim)."""
        parts = [
            _attend(g, q[g.start : g.end], k_cache, v_cache, scale, self.softcap, sinks)
            for g in self.groups
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.empty_rows is not None:
            # a padding row attends to nothing: its softmax is NaN; zeros out
            out = out.masked_fill(self.empty_rows[:, None, None], 0.0)
        return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (num_seqs, num_heads, head_dim); context_lens (num_seqs,) int32 count the
    current token, whose K/V are already stored (0 for a padding row, whose
    output is zeros). window: the query sees only its last `window` keys;
    softcap: scores -> softcap * tanh(scores / softcap); sinks (num_heads,):
    per-head sink logits (gpt-oss). Returns (num_seqs, num_heads, head_dim)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    use_kernel = q.dtype in (torch.float32, torch.bfloat16)
    plan = plan_decode(block_tables, context_lens, k_cache, v_cache, use_kernel, window, softcap)
    return plan(q, k_cache, v_cache, scale, sinks)


def plan_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    use_kernel: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> KernelDecode | TorchDecode:
    """The step's decode plan: the C kernel where it applies, else torch."""
    plan = None
    if use_kernel:
        plan = plan_kernel_decode(block_tables, context_lens, k_cache, v_cache, window, softcap)
    return plan or plan_torch_decode(
        block_tables, context_lens, k_cache.shape[1], k_cache.dtype, window, softcap
    )


def plan_torch_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    softcap: float | None = None,
) -> TorchDecode:
    lengths = context_lens.tolist()
    device = block_tables.device
    if window is not None and block_tables.numel():
        # blocks wholly before a row's window may belong to another sequence by
        # now: the row reads its first window block in their place (masked anyway)
        first = (context_lens.long() - window).clamp(min=0) // block_size
        columns = torch.arange(block_tables.shape[1], device=device)[None, :]
        columns = torch.maximum(columns, first[:, None]).clamp(max=block_tables.shape[1] - 1)
        block_tables = block_tables.gather(1, columns)
    empty = torch.tensor([n == 0 for n in lengths], device=device) if 0 in lengths else None
    groups = []
    for start, end in _length_groups(lengths):
        rows = lengths[start:end]
        num_blocks = max(-(-max(rows) // block_size), 1)
        length = num_blocks * block_size
        mask = None
        slid = window is not None and any(n > window for n in rows)
        if slid or any(n != length for n in rows):
            pos = torch.arange(length, device=device)[None, :]
            ends = torch.tensor(rows, device=device)[:, None]
            hidden = pos >= ends
            if window is not None:
                hidden |= pos < ends - window  # slid out of the window
            mask = torch.zeros(len(rows), 1, 1, length, dtype=dtype, device=device)
            mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
        gather = block_tables[start:end, :num_blocks].reshape(-1).long()
        groups.append(_Group(start, end, gather, mask))
    return TorchDecode(groups, empty, softcap)


def _attend(
    group: _Group,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    rows = group.end - group.start
    keys = k_cache.index_select(0, group.gather).view(rows, -1, *k_cache.shape[2:])
    values = v_cache.index_select(0, group.gather).view(rows, -1, *v_cache.shape[2:])
    if softcap is not None:
        return _softcapped(q, keys, values, group.mask, scale, softcap, sinks)
    # SDPA's fused CPU kernel takes the strided (S, Hk, L, D) views and GQA as is
    args = (q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2))  # q (S, H, 1, D)
    if sinks is not None:
        return attention_with_sinks(*args, sinks, scale, group.mask).squeeze(2)
    out = F.scaled_dot_product_attention(*args, attn_mask=group.mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _softcapped(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA has no soft-capping: q (S, H, D) over keys/values (S, L, Hk, D) by hand, in fp32."""
    group = q.shape[1] // keys.shape[2]
    k = keys.float().repeat_interleave(group, dim=2).transpose(1, 2)  # (S, H, L, D)
    v = values.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q.float().unsqueeze(2), k.transpose(2, 3)) * scale  # (S, H, 1, L)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    if sinks is not None:  # one more column per head, no value
        scores = torch.cat(
            (scores, sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)), -1
        )
    weights = scores.softmax(dim=-1)[..., : v.shape[2]]
    return torch.matmul(weights, v).squeeze(2).to(q.dtype)


def _length_groups(lengths: list[int], max_waste: float = 0.3) -> list[tuple[int, int]]:
    """Row ranges [start, end) of similar length, for rows sorted longest first:
    each range padded to its first row wastes at most about max_waste of its
    work. At most 3 ranges; one when unsorted."""
    if any(a < b for a, b in itertools.pairwise(lengths)):
        return [(0, len(lengths))]
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if (
            i > start
            and len(groups) < 2
            and lengths[start] * (i - start + 1) > (1 + max_waste) * (total + n)
        ):
            groups.append((start, i))
            start, total = i, 0
        total += n
    groups.append((start, len(lengths)))
    return groups
