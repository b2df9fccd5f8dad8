"""Split-K (flash-decoding) for paged decode attention: how many splits to
launch, and the kernel that merges the splits' partial softmax states.

Decode has one query per sequence, so a launch has only num_seqs x
num_kv_heads programs. When that is too few to fill the GPU (small batches,
long contexts), each sequence's context is cut into NUM_SPLITS pieces that run
in parallel and are merged here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits are powers of two (the merge kernel aranges over them and each value
# is a separate compile) and at most this many.
MAX_SPLITS = 64
# Below this many context tokens per split, the merge costs more than it saves.
MIN_TOKENS_PER_SPLIT = 256
# Aim for this many programs per SM so each SM has work to overlap memory latency.
PROGRAMS_PER_SM = 4
# SM count assumed when no CUDA device is at hand (interpreter): an H100/H200.
DEFAULT_NUM_SMS = 132


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, none that would be tiny.

    Every value is correct for every context length (each sequence divides its
    own context among the splits), so a CUDA graph captured with one choice
    stays correct when replayed with longer contexts.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = PROGRAMS_PER_SM * sm_count // programs
    useful = triton.cdiv(max(max_context_len, 1), MIN_TOKENS_PER_SPLIT)
    splits = max(min(wanted, useful, MAX_SPLITS), 1)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@triton.jit
def merge_splits_kernel(
    out_ptr,  # (num_seqs, num_heads, head_dim)
    part_acc_ptr,  # (num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD) fp32, unnormalised p @ v
    part_max_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32, log2-domain running max
    part_sum_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32, sum of exp2(s - max)
    sinks_ptr,  # (num_heads,) sink logits when HAS_SINKS: one more column, no value
    out_stride_s,
    out_stride_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # One program per (sequence, query head) merges that head's splits.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * num_heads + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    part_m = tl.load(part_max_ptr + row * NUM_SPLITS + offs_s)  # (NUM_SPLITS,)
    part_l = tl.load(part_sum_ptr + row * NUM_SPLITS + offs_s)
    m_all = tl.max(part_m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 domain
        m_all = tl.maximum(m_all, sink)
    # Empty splits (short contexts) hold m = -inf, l = 0, acc = 0 and weigh
    # nothing; an all-empty row (context 0) keeps total = 0 and yields zeros.
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(part_m - m_all)  # (NUM_SPLITS,), 0 for empty splits
    total = tl.sum(w * part_l, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    acc_ptrs = part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    acc = tl.sum(tl.load(acc_ptrs) * w[:, None], 0)  # (HEAD_DIM_PAD,)
    out = acc / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * out_stride_s + head * out_stride_h + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
