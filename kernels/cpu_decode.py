"""The CPU path's paged decode attention: one query token per sequence.

Same signature as the Triton kernel and the oracle (``dense.py``), which its
tests compare it with. Layouts are those of ``reference.py``.

Gathering each row's blocks and SDPA over them are memory-bound; what is
left is deciding how to cut the batch, and that is the same for every layer
of a step. So ``plan_decode`` builds a ``DecodePlan`` (row groups, flat block
ids to gather, additive masks) once per step and every layer runs it with
``run_decode``.

How the batch is cut:
- rows that all start with the same blocks (a shared prompt prefix) run as a
  cascade: every query attends to the prefix once, as one batch, then each
  to its own suffix, and the two softmax parts merge by log-sum-exp;
- the other rows, sorted longest first (as the scheduler orders decodes), run
  in a few length groups, so short ones are not padded to the longest.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Group:
    """Rows padded to one length; their gathered K/V is (rows, length, Hk, D)."""

    rows: slice | torch.Tensor  # which rows of q
    num_rows: int
    gather: torch.Tensor  # (num_rows * num_blocks,) int64 block ids
    mask: torch.Tensor | None  # (num_rows, 1, 1, length) additive; None: nothing hidden


@dataclass(slots=True)
class _Cascade:
    """Rows sharing their first blocks: the prefix once, then each row's suffix."""

    rows: slice | torch.Tensor
    num_rows: int
    prefix: torch.Tensor  # (shared_blocks,) int64 block ids
    suffix: _Group  # the rest of each row, its rows relative to this cascade


@dataclass(slots=True)
class DecodePlan:
    parts: list[_Group | _Cascade]
    empty_rows: torch.Tensor | None  # (num_seqs,) bool: context 0, output zeros


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """q (num_seqs, num_heads, head_dim); context_lens (num_seqs,) int32 count the
    current token, whose K/V are already stored (0 for a padding row, whose
    output is zeros). Returns (num_seqs, num_heads, head_dim)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = plan_decode(block_tables, context_lens, k_cache.shape[1], q.dtype)
    return run_decode(plan, q, k_cache, v_cache, scale)


def run_decode(
    plan: DecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """One layer's decode attention, cut as ``plan`` says; q (num_seqs, num_heads, head_dim)."""
    if len(plan.parts) == 1 and isinstance(plan.parts[0].rows, slice):
        out = _run_part(plan.parts[0], q, k_cache, v_cache, scale)
    else:
        out = torch.empty_like(q)
        for part in plan.parts:
            out[part.rows] = _run_part(part, q[part.rows], k_cache, v_cache, scale)
    if plan.empty_rows is not None:
        # a padding row attends to nothing: its softmax is NaN; zeros out
        out = out.masked_fill(plan.empty_rows[:, None, None], 0.0)
    return out


def plan_decode(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype: torch.dtype
) -> DecodePlan:
    """How to cut a step's decode rows (the same for every layer of the step)."""
    lengths = context_lens.tolist()
    device = block_tables.device
    empty = torch.tensor([n == 0 for n in lengths], device=device) if 0 in lengths else None
    num_seqs = len(lengths)
    rows, shared = _rows_sharing_a_prefix(block_tables, lengths, block_size)
    if not shared:
        return DecodePlan(list(_groups(block_tables, lengths, block_size, dtype)), empty)
    cascade = _cascade(block_tables, lengths, block_size, dtype, rows, shared)
    if len(rows) == num_seqs:
        cascade.rows = slice(0, num_seqs)
        return DecodePlan([cascade], empty)
    taken = set(rows)
    rest = [i for i in range(num_seqs) if i not in taken]
    idx = torch.tensor(rest, device=device)
    group = _group(
        block_tables[idx], [lengths[i] for i in rest], block_size, dtype, idx,
        max(lengths[i] for i in rest),
    )  # fmt: skip
    return DecodePlan([cascade, group], empty)


def _groups(
    block_tables: torch.Tensor, lengths: list[int], block_size: int, dtype: torch.dtype
) -> list[_Group]:
    """Length groups of rows sorted longest first; each padded to its first row."""
    return [
        _group(block_tables[a:b], lengths[a:b], block_size, dtype, slice(a, b), max(lengths[a:b]))
        for a, b in _length_groups(lengths)
    ]


def _group(
    block_tables: torch.Tensor,
    lengths: list[int],
    block_size: int,
    dtype: torch.dtype,
    rows: slice | torch.Tensor,
    max_len: int,
) -> _Group:
    """One padded group of rows; block_tables and lengths are those rows'."""
    num_blocks = max(-(-max_len // block_size), 1)
    gather = block_tables[:, :num_blocks].reshape(-1).long()
    length = num_blocks * block_size
    mask = None
    if any(n != length for n in lengths):
        lens = torch.tensor(lengths, device=block_tables.device)
        hidden = torch.arange(length, device=block_tables.device)[None, :] >= lens[:, None]
        mask = torch.zeros(len(lengths), 1, 1, length, dtype=dtype, device=block_tables.device)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
    return _Group(rows, len(lengths), gather, mask)


def _cascade(
    block_tables: torch.Tensor,
    lengths: list[int],
    block_size: int,
    dtype: torch.dtype,
    rows: list[int],
    shared: int,
) -> _Cascade:
    """Every row keeps at least one suffix token (shared <= (min context - 1) // block_size)."""
    idx = torch.tensor(rows, device=block_tables.device)
    tables = block_tables[idx]
    prefix_len = shared * block_size
    suffix_lens = [lengths[i] - prefix_len for i in rows]
    suffix = _group(
        tables[:, shared:], suffix_lens, block_size, dtype, slice(0, len(rows)), max(suffix_lens)
    )
    return _Cascade(idx, len(rows), tables[0, :shared].long(), suffix)


def _run_part(
    part: _Group | _Cascade,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if isinstance(part, _Cascade):
        return _cascade_decode(part, q, k_cache, v_cache, scale)
    keys = _gather(k_cache, part)  # (S, L, Hk, D)
    values = _gather(v_cache, part)
    # SDPA's fused CPU kernel takes the strided (S, Hk, L, D) views and GQA as is
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (S, H, 1, D)
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=part.mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _gather(cache: torch.Tensor, group: _Group) -> torch.Tensor:
    """(rows, num_blocks * block_size, num_kv_heads, head_dim) from each row's blocks."""
    blocks = cache.index_select(0, group.gather)  # (rows * nb, bs, Hk, D)
    return blocks.view(group.num_rows, -1, *cache.shape[2:])


def _cascade_decode(
    part: _Cascade, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    prefix_len = part.prefix.shape[0] * block_size
    kp = k_cache.index_select(0, part.prefix).view(1, prefix_len, num_kv_heads, head_dim)
    vp = v_cache.index_select(0, part.prefix).view(1, prefix_len, num_kv_heads, head_dim)
    # every row's query heads of one KV head side by side: (1, Hk, S * group, D)
    qp = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    qp = qp.reshape(1, num_kv_heads, num_seqs * group, head_dim)
    out_p, lse_p = _flash_with_lse(qp, kp.transpose(1, 2), vp.transpose(1, 2), None, scale)
    out_p = out_p.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    lse_p = lse_p.view(num_kv_heads, num_seqs, group).transpose(0, 1)

    ks = _gather(k_cache, part.suffix)  # (S, Ls, Hk, D)
    vs = _gather(v_cache, part.suffix)
    out_s, lse_s = _flash_with_lse(
        q.view(num_seqs, num_kv_heads, group, head_dim), ks.transpose(1, 2), vs.transpose(1, 2),
        part.suffix.mask, scale,
    )  # fmt: skip

    top = torch.maximum(lse_p, lse_s)
    w_p = torch.exp(lse_p - top).unsqueeze(-1)
    w_s = torch.exp(lse_s - top).unsqueeze(-1)
    out = (out_p * w_p + out_s * w_s) / (w_p + w_s)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D) attention and its log-sum-exp (B, H, Lq), for merging partial results."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, lse


def _length_groups(lengths: list[int], max_waste: float = 0.3) -> list[tuple[int, int]]:
    """Row ranges [start, end) of similar length, for rows sorted longest first
    (the scheduler orders decodes so): each range padded to its first row wastes
    at most about max_waste of its work. At most 3 ranges; one when unsorted."""
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


def _rows_sharing_a_prefix(
    block_tables: torch.Tensor, lengths: list[int], block_size: int
) -> tuple[list[int], int]:
    """The largest set of rows starting with the same block, and how many
    leading blocks they all share (0: no such set worth a cascade)."""
    firsts = block_tables[:, 0].tolist()
    first, count = Counter(firsts).most_common(1)[0]
    if count < 2:
        return [], 0
    rows = [i for i, f in enumerate(firsts) if f == first]
    tables = block_tables if count == len(firsts) else block_tables[torch.tensor(rows)]
    # every row keeps at least one token of its own after the shared part
    max_blocks = (min(lengths[i] for i in rows) - 1) // block_size
    return rows, _shared_prefix_blocks(tables, max_blocks)


def _shared_prefix_blocks(block_tables: torch.Tensor, max_blocks: int) -> int:
    """How many leading blocks every row shares (a prefix-cache hit common to the batch)."""
    if max_blocks <= 0 or block_tables.shape[0] < 2:
        return 0
    head = block_tables[:, :max_blocks]
    same = (head == head[:1]).all(dim=0)  # (max_blocks,)
    return int(same.cumprod(dim=0).sum())
