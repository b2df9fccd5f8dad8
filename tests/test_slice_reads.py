"""A tensor-parallel rank reads only its slice of each split tensor: the reader
(worker/models/loader.py, ``Slice`` in worker/models/tensor_store.py) reads bit for bit
what slicing the whole tensor gives, and only those bytes; worker/models/tensor_shard.py's
``RankSlices`` picks each rank's part, so a rank of a toy model reads its shard of the
projections, embedding and LM head and the norms whole, and nothing else. That two ranks
still give one rank's tokens: tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchgen.kernels.ops import select_ops
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.loader import read_checkpoint
from batchgen.worker.models.registry import load_model_config
from batchgen.worker.models.tensor_parallel import build_sharded_model
from batchgen.worker.models.tensor_shard import RankSlices, Shard, Split, split_heads, vocab_span
from batchgen.worker.models.tensor_store import Slice

CPU = torch.device("cpu")
# (slice, read calls on a (7, 13) tensor): ranges that meet are read as one
SLICES = [
    (Slice(0, ((2, 5),)), 1),
    (Slice(0, ((0, 2), (4, 7))), 2),
    (Slice(0, ((0, 3), (3, 7))), 1),  # meeting runs: the whole tensor, one read
    (Slice(1, ((3, 10),)), 7),  # one range per row
    (Slice(1, ((0, 1), (5, 9), (12, 13))), 15),  # a row's last run meets the next row's first
    (Slice(1, ((0, 13),)), 1),  # every column: the rows meet
    (Slice(1, ((4, 4),)), 0),  # an empty run (a rank past the vocabulary's end)
]


def _indices(part: Slice) -> torch.Tensor:
    return torch.tensor(
        [i for start, stop in part.runs for i in range(start, stop)], dtype=torch.long
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_slice_reads_as_slicing_the_whole_tensor_and_only_its_bytes(tmp_path: Path, dtype):
    whole = torch.randn(7, 13, generator=torch.Generator().manual_seed(1)).to(dtype)
    save_file({"pad": torch.ones(3), "w": whole}, str(tmp_path / "model.safetensors"))
    for part, calls in SLICES:
        store = read_checkpoint(tmp_path, CPU, dtype)
        got = store.take("w", part=part)
        want = whole.index_select(part.dim, _indices(part))
        assert got.shape == want.shape, part
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), part
        assert store.reads.bytes == want.numel() * want.element_size(), part
        assert store.reads.calls == calls, part


def test_odd_sizes_split_into_every_index_once(tmp_path: Path):
    """6 heads of 5 and 3 KV heads, an intermediate width and a vocabulary of 1001, on 3
    ranks: put side by side, the ranks' slices of each split tensor are the whole of it."""
    heads, kv, dim, inter, vocab, world = 6, 3, 5, 1001, 1001, 3
    g = torch.Generator().manual_seed(2)
    tensors = {
        "qkv": torch.randn((heads + 2 * kv) * dim, 4, generator=g),
        "gate_up": torch.randn(2 * inter, 4, generator=g).bfloat16(),
        "o": torch.randn(4, heads * dim, generator=g).half(),
        "down": torch.randn(4, inter, generator=g),
        "embed": torch.randn(vocab, 4, generator=g),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    splits = {"qkv": Split.QKV, "gate_up": Split.GATE_UP, "o": Split.OUT, "down": Split.DOWN,
              "embed": Split.VOCAB}  # fmt: skip
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in tensors}
    for rank in range(world):
        shard = Shard(rank, world)
        slices = RankSlices(split_heads(heads, kv, shard, "m"), dim, heads, kv,
                            shard.span(inter), inter, vocab_span(vocab, shard)[0])  # fmt: skip
        store = read_checkpoint(tmp_path, CPU, torch.float32)
        for name, split in splits.items():
            parts[name].append(store.take(name, part=slices.of(split)).to(tensors[name].dtype))
    # qkv: each rank its 2 query heads' rows, then its KV head's k rows, then its v rows
    q, k, v = (torch.cat([p[a:b] for p in parts["qkv"]])
               for a, b in ((0, 2 * dim), (2 * dim, 3 * dim), (3 * dim, 4 * dim)))  # fmt: skip
    assert torch.equal(torch.cat((q, k, v)), tensors["qkv"])
    spans = [b - a for a, b in (Shard(r, world).span(inter) for r in range(world))]
    assert spans == [333, 334, 334]
    gate = torch.cat([p[:n] for p, n in zip(parts["gate_up"], spans, strict=True)])
    up = torch.cat([p[n:] for p, n in zip(parts["gate_up"], spans, strict=True)])
    assert torch.equal(torch.cat((gate, up)), tensors["gate_up"])
    assert torch.equal(torch.cat(parts["o"], dim=1), tensors["o"])
    assert torch.equal(torch.cat(parts["down"], dim=1), tensors["down"])
    assert torch.equal(torch.cat(parts["embed"]), tensors["embed"])
    assert [p.shape[0] for p in parts["embed"]] == [334, 334, 333]


def _whole(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # tied embeddings; an LM head
def test_each_rank_reads_its_shard_and_the_norms_and_nothing_else(toy_model, arch):
    """The tiny toy on 2 ranks splits every projection, the embedding and the LM head in
    half (4 heads, 2 KV heads, 1024 intermediate, 8192 vocabulary), so a rank reads half
    their bytes and the norms whole; its layer 0 is the whole tensors' slices."""
    path = toy_model(arch)
    whole = _whole(path)
    nbytes = {name: t.numel() * t.element_size() for name, t in whole.items()}
    norms = sum(n for name, n in nbytes.items() if name.endswith("norm.weight"))
    config = load_model_config(path)
    read = []
    for rank in range(2):
        model = build_sharded_model(path, config, CPU, torch.float32, select_ops(CPU), 64,
                                    Shard(rank, 2))  # fmt: skip
        assert model.reads.bytes == (sum(nbytes.values()) - norms) // 2 + norms
        read.append(model.reads.bytes)
        layer: Any = model.weights.layers[0]  # ReducedAttention / ReducedMlp blocks
        p = "model.layers.0."
        q0, kv0, i0, v0 = 128 * rank, 64 * rank, 512 * rank, 4096 * rank  # 2 heads of 64 each
        qkv = torch.cat((whole[p + "self_attn.q_proj.weight"][q0 : q0 + 128],
                         whole[p + "self_attn.k_proj.weight"][kv0 : kv0 + 64],
                         whole[p + "self_attn.v_proj.weight"][kv0 : kv0 + 64]))  # fmt: skip
        assert torch.equal(layer.attention.block.qkv.weight, qkv.t())
        o = whole[p + "self_attn.o_proj.weight"][:, q0 : q0 + 128]
        assert torch.equal(layer.attention.block.o.weight, o.t())
        up = torch.cat((whole[p + "mlp.gate_proj.weight"][i0 : i0 + 512],
                        whole[p + "mlp.up_proj.weight"][i0 : i0 + 512]))  # fmt: skip
        assert torch.equal(layer.mlp.block.up.weight, up.t())
        down = whole[p + "mlp.down_proj.weight"][:, i0 : i0 + 512]
        assert torch.equal(layer.mlp.block.down.weight, down.t())
        embed = whole["model.embed_tokens.weight"][v0 : v0 + 4096]
        assert torch.equal(model.weights.embed, embed)
        head = whole.get("lm_head.weight", whole["model.embed_tokens.weight"])[v0 : v0 + 4096]
        assert torch.equal(model.weights.lm_head.weight, head.t())
    assert read[0] + read[1] == sum(nbytes.values()) + norms


def test_a_file_cut_after_its_header_was_read_is_refused_where_a_slice_reaches_the_cut(
    tmp_path: Path,
):
    """(A file short before the load is refused by every rank at its header:
    tests/test_checkpoint_reads.py.)"""
    whole = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    file = tmp_path / "model.safetensors"
    save_file({"w": whole}, str(file))
    first, store = (read_checkpoint(tmp_path, CPU, torch.float32) for _ in range(2))
    file.write_bytes(file.read_bytes()[:-8])  # the last two values of row 7
    assert torch.equal(first.take("w", part=Slice(1, ((0, 12),))), whole[:, :12])
    with pytest.raises(UnsupportedModelError, match=rf"^{file}: tensor 'w' of 512 bytes for "
                       r"\(8, 16\) torch.float32 ends after 504 \(a truncated or damaged "
                       r"checkpoint\)$"):  # fmt: skip
        store.take("w", part=Slice(1, ((12, 16),)))
