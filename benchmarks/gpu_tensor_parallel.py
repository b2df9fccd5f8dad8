"""gpu_check section 6: a Llama-3.3-70B-shaped random bf16 checkpoint, as many of its 80
layers as the machine holds, through the engine over tensor_parallel_size = min(2, GPUs).

The checkpoint is written on the machine itself: each layer's random tensors made on
the device and saved as a safetensors shard of its own in /dev/shm (in the temporary
folder where /dev/shm has less room), with the toy tokenizer
(``batchgen/toy/tokenizer.py``; prompts are random ids below its vocabulary). Its layer
count is the least of four bounds, each recorded: what one rank's free GPU memory holds
(its share of the weights, a KV pool for the workload and a workspace), what host memory
and the folder hold (the shards, and with ranks > 1 the shard each rank cuts on the CPU,
``worker/models/tensor_parallel.py``), what ``WRITE_BUDGET_S`` lets it write, and the
model's own 80. Nothing is extrapolated to 80 layers.

Measured: load seconds (read, move, warm-up, CUDA graphs) apart from the run; the
engine's decode step time while every sequence decodes (median), against the roofline
per rank: (its share of the weights + the KV its sequences read) / bandwidth, at the
device's data-sheet bandwidth and at its measured copy bandwidth; the greedy tokens of
tp=N against tp=1 when N > 1 and the layers fit one GPU. ``--dry-run``: two CPU ranks
over gloo at tiny shapes in fp32, against one rank.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_bench import Bench

# HBM bandwidth, bytes/s (NVIDIA's data sheets); "H100 NVL" and "H100 PCIe" before "H100"
SPEC_BANDWIDTH = {"H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tokenizer_vocab: int
    model_layers: int  # the real model's
    max_positions: int
    prompts: int  # the workload: random prompts, greedy, EOS ignored
    prompt_lens: tuple[int, int]
    new_tokens: int
    workspace_bytes: int  # a rank's activations, graphs' pools, cuBLAS: beyond weights and KV
    write_budget_s: float  # writing stops at the first layer past it

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def max_len(self) -> int:
        return self.prompt_lens[1] + self.new_tokens

    def matrices(self) -> int:
        """One layer's split weights: q, k, v, o, gate, up, down."""
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * self.hidden + 2 * kv + 3 * self.intermediate)


LLAMA_70B = Shape("Llama-3.3-70B-shaped", 8192, 64, 8, 28672, 128256, 8192, 80, 131072,
                  prompts=64, prompt_lens=(96, 160), new_tokens=48, workspace_bytes=6 << 30,
                  write_budget_s=45.0)  # fmt: skip
# the dry run's: GQA 8 and an intermediate 3.5 x hidden as the 70B's, 3 layers for its 80
TINY = Shape("a tiny stand-in for Llama-3.3-70B", 128, 16, 2, 448, 1024, 512, 3, 131072,
             prompts=4, prompt_lens=(4, 12), new_tokens=6, workspace_bytes=0,
             write_budget_s=60.0)  # fmt: skip
DRY_RUN_FREE_BYTES = 64 << 20  # the dry run's stand-in for a GPU's free memory
BLOCK_SIZE = 16
USABLE = 0.95  # of a GPU's free memory
HOST_MARGIN = 8 << 30  # host memory left to the processes themselves
WRITERS, MAX_PENDING = 8, 4  # threads writing shards; layers copied to the host, not written


def kv_blocks(s: Shape) -> int:
    return s.prompts * -(-s.max_len // BLOCK_SIZE) + 16


def local_kv_heads(s: Shape, ranks: int) -> int:
    return max(1, s.kv_heads // ranks)  # replicated when the ranks outnumber them


def gpu_layers(s: Shape, free_bytes: int, ranks: int, width: int) -> int:
    """Layers whose weights (this rank's share), KV pool and workspace fit ``free_bytes``."""
    fixed = 2 * s.vocab * s.hidden * width // ranks + s.workspace_bytes  # embedding, LM head
    kv = kv_blocks(s) * BLOCK_SIZE * 2 * local_kv_heads(s, ranks) * s.head_dim * width
    per_layer = (s.matrices() // ranks + 2 * s.hidden) * width + kv
    return max(0, int((USABLE * free_bytes - fixed) // per_layer))


def host_layers(s: Shape, room_bytes: int, ranks: int) -> int:
    """Layers whose bf16 shards fit ``room_bytes`` of host memory (twice with ranks > 1:
    the shards, and the pieces the ranks cut from them on the CPU)."""
    copies = 1 if ranks == 1 else 2
    fixed, per_layer = 2 * s.vocab * s.hidden * 2, (s.matrices() + 2 * s.hidden) * 2
    return max(0, int((room_bytes / copies - fixed) // per_layer))


def checkpoint_folder(need_bytes: int) -> tuple[Path, int]:
    """/dev/shm when it has ``need_bytes`` of room, else whichever of it and the temporary
    folder has more; and its room, at most the host's available memory less
    ``HOST_MARGIN``."""
    available = HOST_MARGIN
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    rooms = {p: min(shutil.disk_usage(p).free, available - HOST_MARGIN)
             for p in map(Path, ("/dev/shm", tempfile.gettempdir())) if p.is_dir()}  # fmt: skip
    shm = Path("/dev/shm")
    best = shm if rooms.get(shm, 0) >= need_bytes else max(rooms, key=lambda p: rooms[p])
    return best, rooms[best]


def write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """``tensors`` (bf16, on the CPU) as one safetensors file: its header, then each
    tensor's bytes written from its own memory (a write releases the GIL, so writers run
    side by side; safetensors' ``save_file`` first copies each tensor into a bytes)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16 and t.is_contiguous()
        size = t.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors.values():
            f.write(t.view(torch.uint8).numpy().data)


def write_checkpoint(folder: Path, s: Shape, layers: int, device: Any, seed: int = 0) -> dict:
    """Up to ``layers`` layers (fewer once ``s.write_budget_s`` has passed), a shard each,
    random bf16 made on ``device``; its config, index and the toy tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig

    from batchgen.toy.tokenizer import EOS_TOKEN, train_tokenizer

    t0 = time.perf_counter()
    train_tokenizer(folder, s.tokenizer_vocab, s.max_positions, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}

    def rand(*shape: int) -> Any:  # std 1.5/sqrt(fan in), as batchgen/toy/checkpoint.py
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)
        return x.mul_(1.5 / shape[-1] ** 0.5)

    def norm() -> Any:
        return torch.rand(s.hidden, generator=gen, device=device).add_(0.5).bfloat16()

    pending: list[Future[None]] = []

    def save(file: str, tensors: dict[str, Any]) -> None:  # copied here, written by a writer
        while len(pending) >= MAX_PENDING:
            pending.pop(0).result()
        host = {k: v.cpu() for k, v in tensors.items()}
        pending.append(writers.submit(write_safetensors, folder / file, host))
        weight_map.update(dict.fromkeys(tensors, file))

    kv = s.kv_heads * s.head_dim
    writers = ThreadPoolExecutor(WRITERS)
    save("outer.safetensors", {"model.embed_tokens.weight": rand(s.vocab, s.hidden),
                               "model.norm.weight": norm(), "lm_head.weight": rand(s.vocab, s.hidden)})  # fmt: skip
    started, written = time.perf_counter(), 0
    while written < layers and (written == 0 or time.perf_counter() - started < s.write_budget_s):
        p = f"model.layers.{written}."
        save(f"layer{written:03d}.safetensors", {
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": rand(s.hidden, s.hidden),
            p + "self_attn.k_proj.weight": rand(kv, s.hidden),
            p + "self_attn.v_proj.weight": rand(kv, s.hidden),
            p + "self_attn.o_proj.weight": rand(s.hidden, s.hidden),
            p + "mlp.gate_proj.weight": rand(s.intermediate, s.hidden),
            p + "mlp.up_proj.weight": rand(s.intermediate, s.hidden),
            p + "mlp.down_proj.weight": rand(s.hidden, s.intermediate),
        })  # fmt: skip
        written += 1
    for future in pending:
        future.result()
    writers.shutdown()
    eos = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(EOS_TOKEN)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    LlamaConfig(
        hidden_size=s.hidden, num_hidden_layers=written, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab,
        max_position_embeddings=s.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=rope, bos_token_id=None, eos_token_id=eos, dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(str(folder))  # fmt: skip
    size = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"layers": written, "write_seconds": time.perf_counter() - t0, "bytes": size,
            "out_of_write_time": written < layers}  # fmt: skip


def run_engine(path: Path, s: Shape, ranks: int, b: Bench, dtype: str,
               prompts: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    """Loads ``path`` over ``ranks`` ranks (timed apart), then runs ``prompts`` step by step;
    the decode steps are those in which every prompt is past its prefill."""
    import torch

    from batchgen import Engine, SamplingParams

    cuda = b.device.type == "cuda"
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(
        path, device=str(b.device), dtype=dtype, tensor_parallel_size=ranks,
        max_num_seqs=len(prompts), num_kv_blocks=kv_blocks(s), max_model_len=s.max_len,
        enable_prefix_caching=False, threads=None if cuda else 1, model_impl="native",
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        engine.generate([prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        first_call_s = time.perf_counter() - t0
        before = engine.stats()  # the first call's steps and graph replays are not the run's
        params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"tp-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        lens = dict(zip(ids, map(len, prompts)))
        tokens: dict[str, list[int]] = {}
        decode_s, contexts = [], []
        t0 = time.perf_counter()
        while engine.has_unfinished():
            counts = engine.output_token_counts()
            decoding = len(counts) == len(prompts) and min(counts.values()) >= 1
            t = time.perf_counter()
            for out in engine.step():
                tokens[out.request_id] = list(out.token_ids)
            if decoding:
                decode_s.append(time.perf_counter() - t)
                contexts.append(sum(lens[r] + n for r, n in counts.items()))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    generated = sum(len(t) for t in tokens.values())
    return {
        "tensor_parallel_size": ranks, "load_seconds": load_s, "first_call_seconds": first_call_s,
        "seconds": wall,
        "output_tokens": generated, "output_tok_s": generated / wall,
        "decode_steps": len(decode_s), "decode_step_ms": 1e3 * statistics.median(decode_s),
        "mean_kv_tokens_read": statistics.mean(contexts),
        "steps": stats.num_steps - before.num_steps,
        "cuda_graph_replays": stats.cuda_graph_replays - before.cuda_graph_replays,
        "tokens": [tokens[rid] for rid in ids],
    }  # fmt: skip


def roofline(s: Shape, layers: int, ranks: int, width: int, run: dict[str, Any],
             bandwidths: dict[str, float | None]) -> dict[str, Any]:  # fmt: skip
    """A decode step's bytes per rank (its weights + the KV it reads; embedding rows left
    out) over each bandwidth, and the measured step's fraction of that floor."""
    weights = (layers * (s.matrices() // ranks + 2 * s.hidden) + s.vocab * s.hidden // ranks
               + s.hidden) * width  # fmt: skip
    kv = run["mean_kv_tokens_read"] * layers * 2 * local_kv_heads(s, ranks) * s.head_dim * width
    out: dict[str, Any] = {"weight_bytes_per_rank": weights, "kv_bytes_per_rank": kv}
    for name, bw in bandwidths.items():
        if bw:
            floor_ms = 1e3 * (weights + kv) / bw
            out[name] = {"gb_per_s": bw / 1e9, "floor_ms": floor_ms,
                         "fraction": floor_ms / run["decode_step_ms"]}  # fmt: skip
    return out


def progress(line: str) -> None:
    """To the section's log (its stderr): where a run that timed out had got to."""
    print(f"tensor_parallel: {line}", file=sys.stderr, flush=True)


def tensor_parallel(b: Bench) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_kernels import copy_bandwidth

    cuda = b.device.type == "cuda"
    s = LLAMA_70B if cuda else TINY
    ranks = min(2, torch.cuda.device_count()) if cuda else 2
    dtype, width = ("bfloat16", 2) if cuda else ("float32", 4)
    copy_bw = copy_bandwidth(b)
    if cuda:
        torch.cuda.empty_cache()
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(ranks))
    else:
        free = DRY_RUN_FREE_BYTES
    name = torch.cuda.get_device_name() if cuda else ""
    spec = next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)
    on_gpu = min(gpu_layers(s, free, ranks, width), s.model_layers)
    folder, room = checkpoint_folder(2 * (on_gpu * s.matrices() + 2 * s.vocab * s.hidden))
    bounds: dict[str, int | None] = {
        "gpu_memory": gpu_layers(s, free, ranks, width),
        "host_memory": host_layers(s, room, ranks),
        "model": s.model_layers,
    }
    want = min(v for v in bounds.values() if v is not None)
    result: dict[str, Any] = {
        "shape": asdict(s), "tensor_parallel_size": ranks, "gpus": torch.cuda.device_count(),
        "dtype": dtype, "free_bytes_per_gpu": free, "checkpoint_folder": str(folder),
        "checkpoint_room_bytes": room, "layer_bounds": bounds,
    }  # fmt: skip
    if want < 1:
        return {**result, "all_pass": False, "error": "not one layer fits", "layers": 0}
    with tempfile.TemporaryDirectory(prefix="batchgen-70b-", dir=folder) as tmp:
        progress(f"writing up to {want} layers to {tmp}; layer bounds {bounds}")
        written = write_checkpoint(Path(tmp), s, want, b.device)
        progress(f"wrote {written}")
        layers = written["layers"]
        bounds["write_time"] = layers if written["out_of_write_time"] else None
        known = {k: v for k, v in bounds.items() if v is not None}
        result["bound_by"] = min(known, key=lambda k: (known[k], k != "write_time"))
        result.update(layers=layers, checkpoint=written, model=(
            f"{s.name} (hidden {s.hidden}, {s.heads} heads, {s.kv_heads} KV heads, intermediate "
            f"{s.intermediate}, vocab {s.vocab}) with {layers} of its {s.model_layers} layers, "
            f"random bf16, run in {dtype}"))  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
        gen = torch.Generator().manual_seed(0)
        lens = torch.randint(*s.prompt_lens, (s.prompts,), generator=gen).tolist()
        prompts = [torch.randint(0, s.tokenizer_vocab, (n,), generator=gen).tolist() for n in lens]
        progress(f"loading and running at tensor_parallel_size {ranks}")
        split = run_engine(Path(tmp), s, ranks, b, dtype, prompts)
        one = None
        if ranks > 1 and gpu_layers(s, free, 1, width) >= layers:
            progress("loading and running at tensor_parallel_size 1")
            one = run_engine(Path(tmp), s, 1, b, dtype, prompts)
    result["run"] = split
    result["roofline"] = roofline(s, layers, ranks, width, split,
                                  {"spec": spec, "copy": copy_bw})  # fmt: skip
    complete = split["output_tokens"] == s.prompts * s.new_tokens
    if one is not None:
        result["one_rank"] = one
        result["greedy_equal"] = one["tokens"] == split["tokens"]
        result["first_divergence"] = [  # per prompt: the first token that differs, or None
            next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), None)
            for a, c in zip(split["tokens"], one["tokens"])
        ]
    elif ranks > 1:
        result["greedy_equal"] = None
        result["parity_skipped"] = f"{layers} layers do not fit one GPU"
    else:
        result["greedy_equal"] = None
        result["parity_skipped"] = "one GPU: tensor_parallel_size 1 only"
    result["all_pass"] = complete and result["greedy_equal"] is not False
    return result


def table_lines(result: dict[str, Any]) -> list[str]:
    """gpu_check's rows for this section."""
    if "run" not in result:
        return [f"  {result.get('error', 'no run')}: bounds {result.get('layer_bounds')}"]
    run, c = result["run"], result["checkpoint"]
    lines = [
        f"  {result['layers']} of {result['shape']['model_layers']} layers "
        f"(bound: {result['bound_by']}), {c['bytes'] / 1e9:.1f} GB written in "
        f"{c['write_seconds']:.1f} s to {result['checkpoint_folder']}",
        f"  tp {run['tensor_parallel_size']}: load {run['load_seconds']:.1f} s, decode step "
        f"{run['decode_step_ms']:.2f} ms ({result['shape']['prompts']} seqs, "
        f"{run['decode_steps']} steps), {run['output_tok_s']:.0f} output tok/s",
    ]
    for name in ("spec", "copy"):
        if name in result["roofline"]:
            r = result["roofline"][name]
            lines.append(f"  roofline at {name} {r['gb_per_s']:.0f} GB/s: {r['floor_ms']:.2f} ms "
                         f"({r['fraction']:.0%} of it reached)")  # fmt: skip
    equal = result["greedy_equal"]
    lines.append(f"  greedy tokens tp {run['tensor_parallel_size']} vs tp 1: " + (
        result["parity_skipped"] if equal is None else "equal" if equal else
        f"DIFFER (first divergence per prompt {result['first_divergence']})"))  # fmt: skip
    return lines
