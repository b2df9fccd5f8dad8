"""batchgen's engine against HF transformers, side by side in one run.

    python benchmarks/engine_bench.py                 # tiny (N=64) and small (N=32), all peers
    python benchmarks/engine_bench.py --sizes tiny --peers batchgen,hf-continuous
    python benchmarks/engine_bench.py --load 2        # 2 CPU hogs running beside every peer
    python benchmarks/engine_bench.py --sizes small --requests 16   # fewer requests, same mix
    make bench-peers && python benchmarks/engine_bench.py --arch qwen2 --sizes tiny,small,0.5b \
        --peers batchgen,vllm,llama.cpp,llama.cpp:q8_0,ct2,ct2:int8,hf-continuous --dtype bfloat16
    make bench-peers && python benchmarks/engine_bench.py --sizes tiny \
        --peers batchgen,batchgen:int8,llama.cpp:q8_0,ct2:int8   # the int8 systems

Workload "mixed" (seeded): prompts uniform 16..256 tokens, outputs 70% uniform
16..64 and 30% uniform 256..512, random token ids, greedy, EOS off. Peers: HF
generate on static batches of 16 (left padding), HF continuous batching with a
length per request, batchgen, and batchgen-transformers (batchgen's engine on
transformers' own modules, the backend for architectures batchgen has no code
for: beside batchgen it measures what the backend costs). Also: a
shared-prefix workload (512-token common prefix) with prefix caching on and
off, and batchgen's per-step CPU overhead with the model taken out. Every
system runs in its own process (peak RSS is its own) under
torch.inference_mode, with the environment this benchmark was started with:
it sets no thread count or OpenMP variable, so each system threads as its
user would get it (batchgen's processes import batchgen before torch,
as its worker does, and choose their own: worker/cpu_threads.py; HF runs
torch's defaults). ``--load N`` runs N CPU hogs (busy loops, one process
each) for the whole comparison, the same for every system: a machine that
other work shares. The load averages before and after are in the report.

Sizes: tiny (~6M parameters), small (~100M) and 0.5b, Qwen2.5-0.5B's shape
(896 hidden, 24 layers, 14 heads / 2 KV heads, 4864 intermediate, 151936
vocab, tied; always the qwen2 architecture), all random weights written
offline. ``--dtype`` (float32, bfloat16) is every peer's precision; a peer
named ``peer:precision`` runs at its own (``llama.cpp:q8_0``, ``ct2:int8``; ``batchgen:int8``
or ``:fp8`` is batchgen's ``--quantization`` at load, its activations in ``--dtype``).

Other engines (``benchmarks/peer_engines.py``): ``vllm`` (vLLM's CPU build),
``llama.cpp`` (llama-cpp-python on a GGUF conversion of the same checkpoint)
and ``ct2`` (CTranslate2 on its own conversion), each run by the interpreter
of its own venv under ``.venv-peers/`` (``make bench-peers``; never
batchgen's dependencies), threaded by ``PEER_THREADS`` (default 2). Every
peer's generated ids are compared with batchgen's: requests identical, and
the share of tokens before each request's first difference
(``token_agreement``).

batchgen's row also gives its matmul floor: the output tokens over the time
of the run's matrix multiplies alone, timed at every step shape the run used
(benchmarks/matmul_floor.py), and the share of that floor the run reached.
Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# what every system runs with: the environment as started, before anything of batchgen's
# is imported here (batchgen sets GOMP_SPINCOUNT for its own process)
CHILD_ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
HOG = "while True: pass"

SIZES = {"tiny": 64, "small": 32, "0.5b": 16}  # requests per size
ROUND_KEYS = ("output_tok_s", "batchgen_speedup", "floor_share", "matmul_floor_tok_s")
# the workload's token ids are drawn below the tokenizer's vocabulary
VOCAB = {"tiny": 8192, "small": 32000, "0.5b": 32000}


def toy_size(size: str) -> Any:
    """The size's ToySize: 0.5b is Qwen2.5-0.5B's shape (its tokenizer trained to 32000)."""
    from batchgen.toy.checkpoint import SIZES as TOY_SIZES
    from batchgen.toy.checkpoint import ToySize

    if size == "0.5b":
        return ToySize(896, 24, 14, 2, 4864, 151936, max_position_embeddings=32768,
                       tokenizer_vocab_size=32000)  # fmt: skip
    return TOY_SIZES[size]


def model_dir(models: Path, arch: str, size: str) -> Path:
    return models / ("qwen2-0.5b" if size == "0.5b" else f"{arch}-{size}")


def child(args: argparse.Namespace) -> None:
    """Runs one system on one workload in this process; prints one JSON line."""
    if args.peer.startswith("batchgen"):
        importlib.import_module("batchgen")  # before torch: its OpenMP spin, as the worker has
    import torch

    from benchmarks.peers import PEERS
    from benchmarks.workloads import WORKLOADS

    torch.manual_seed(0)
    wl = WORKLOADS[args.workload](args.num_requests, args.vocab)
    kwargs = json.loads(args.engine_kwargs) if args.peer.startswith("batchgen") else {}
    kwargs["dtype"] = args.dtype
    with torch.inference_mode():
        result = PEERS[args.peer](Path(args.model), wl, **kwargs)
    ids = result["token_ids"]
    if "matmul_floor_s" in result:
        result["matmul_floor_tok_s"] = result["output_tokens"] / result["matmul_floor_s"]
        result["floor_share"] = result["matmul_floor_s"] / result["wall_s"]
    result.update(
        peer=args.peer,
        prompt_tokens=wl.prompt_tokens,
        output_tok_s=result["output_tokens"] / result["wall_s"],
        prompt_tok_s=wl.prompt_tokens / result["wall_s"],
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        outputs_digest=hash_ids(ids),
    )
    print("RESULT " + json.dumps(result))


def hash_ids(ids: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """n busy-loop processes for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run_child(
    model: Path, peer: str, workload: str, n: int, vocab: int, dtype: str, **engine: Any
) -> dict:
    """One system on one workload in a process of its own; ``peer`` may name its own
    precision (``ct2:int8``; ``batchgen:int8`` is ``quantization="int8"`` on ``dtype``'s
    floats). Its result keeps the generated ids (``token_ids``)."""
    from benchmarks.peer_venvs import PEER_VENVS, peer_command

    name, _, precision = peer.partition(":")
    run_dtype = precision or dtype
    if name.startswith("batchgen") and precision:  # --dtype's floats, quantized at load
        engine, run_dtype = {**engine, "quantization": precision}, dtype
    common = ["--model", str(model), "--workload", workload, "--num-requests", str(n),
              "--vocab", str(vocab), "--dtype", run_dtype]  # fmt: skip
    env = CHILD_ENV
    if name in PEER_VENVS:
        cmd, env = peer_command(name, common, CHILD_ENV)
    else:
        cmd = [sys.executable, __file__, "--child", "--peer", name, *common,
               "--engine-kwargs", json.dumps(engine)]  # fmt: skip
    # output to files, not pipes: a peer's engine processes (vLLM's) may outlive it holding
    # them; its session's leftovers are ended once it has exited
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, env=env, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        so.seek(0), se.seek(0)
        out = subprocess.CompletedProcess(cmd, proc.returncode, so.read(), se.read())
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result.update(peer=peer, dtype=precision or dtype)
            result.setdefault("prompt_tok_s", result["prompt_tokens"] / result["wall_s"])
            result.setdefault("output_tok_s", result["output_tokens"] / result["wall_s"])
            return result
    raise RuntimeError(f"{peer} on {workload} failed:\n{out.stderr[-3000:]}")


def agreement(ids: list[list[int]], base: list[list[int]]) -> dict[str, Any]:
    """How far a peer's greedy tokens follow batchgen's: requests identical, and the
    share of batchgen's tokens before each request's first difference."""
    same = 0
    for a, b in zip(ids, base):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        same += i
    return {
        "requests_identical": f"{sum(a == b for a, b in zip(ids, base))}/{len(base)}",
        "token_agreement": round(same / max(1, sum(map(len, base))), 4),
    }


def run_step_overhead(model: Path) -> dict:
    """``step_overhead`` in a process of its own, threaded as batchgen's worker is."""
    cmd = [sys.executable, __file__, "--step-overhead", "--model", str(model)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV, cwd=REPO)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"step overhead failed:\n{out.stderr[-3000:]}")


def step_overhead(model: Path, batch: int = 64) -> dict:
    """Mean time of engine.step() with the model forward and logits replaced by
    constant tensors: scheduling, input preparation, sampling and bookkeeping."""
    importlib.import_module("batchgen")  # before torch: its OpenMP spin, as the worker has
    import torch

    from batchgen import Engine, SamplingParams
    from benchmarks.workloads import decode_heavy

    engine = Engine.from_pretrained(model, num_kv_blocks=4096)
    m = engine.runner.model
    hidden = torch.zeros(4096, m.config.hidden_size)
    logits = torch.randn(batch, m.config.vocab_size)
    m.forward = lambda ids, *_: hidden[: ids.shape[0]]  # type: ignore[method-assign]
    m.compute_logits = lambda h: logits[: h.shape[0]]  # type: ignore[method-assign, assignment]
    wl = decode_heavy(batch, m.config.vocab_size)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()  # the prefill step
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return {
        "batch": batch,
        "steps": steps,
        "ms_per_step": (time.perf_counter() - start) / steps * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--peers", default="batchgen,hf-continuous,hf-static")
    p.add_argument("--arch", default="llama", help="of tiny and small; 0.5b is always qwen2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--models-dir", default=None, help="where toy checkpoints are written/reused")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--skip-overhead", action="store_true", help="no per-step overhead probe")
    p.add_argument(
        "--rounds", type=int, default=1, help="run the peers side by side this many times"
    )
    p.add_argument("--load", type=int, default=0, help="CPU hogs running beside every system")
    p.add_argument("--threads", type=int, default=None, help="batchgen's EngineConfig.threads")
    p.add_argument(
        "--requests", type=int, default=None,
        help="requests per size (default: tiny 64, small 32); fewer to fit a busy machine",
    )  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-overhead", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--num-requests", type=int, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--engine-kwargs", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.step_overhead:
        print("RESULT " + json.dumps(step_overhead(Path(args.model))))
        return

    from batchgen.toy import write_toy_checkpoint

    models = Path(args.models_dir or tempfile.mkdtemp(prefix="batchgen-bench-"))
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
        path = model_dir(models, args.arch, size)
        if not (path / "config.json").exists():
            arch = "qwen2" if size == "0.5b" else args.arch
            write_toy_checkpoint(path, arch=arch, size=toy_size(size))
    engine = {} if args.threads is None else {"threads": args.threads}
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "env": {k: CHILD_ENV.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
            "load": args.load, "loadavg_before": os.getloadavg()[0], "dtype": args.dtype,
        },
        "mixed": {}, "rounds": {}, "shared_prefix": {},
    }  # fmt: skip
    with cpu_hogs(args.load):
        compare(args, models, engine, report)
    report["machine"]["loadavg_after"] = os.getloadavg()[0]
    tiny = model_dir(models, args.arch, "tiny")
    if tiny.exists() and not args.skip_overhead:
        report["step_overhead"] = run_step_overhead(tiny)
    print(json.dumps(report, indent=2))
    print_table(report)


def compare(args: argparse.Namespace, models: Path, engine: dict, report: dict) -> None:
    """The peers on each size, side by side, into ``report``."""
    for size in args.sizes.split(","):
        model = model_dir(models, args.arch, size)
        n = args.requests or SIZES[size]
        rounds = []
        for _ in range(args.rounds):
            rows = {}
            for peer in args.peers.split(","):
                try:
                    rows[peer] = run_child(model, peer, "mixed", n, VOCAB[size], args.dtype,
                                           **engine)  # fmt: skip
                except RuntimeError as e:  # one peer failing leaves the others' rows
                    print(f"# {size} {peer} failed: {e}", file=sys.stderr)
                    report.setdefault("failed", {})[f"{size} {peer}"] = str(e)[-1500:]
                    continue
                print(
                    f"# {size} {peer}: {rows[peer]['output_tok_s']:.1f} output tok/s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
            if "batchgen" in rows:
                base = rows["batchgen"]["output_tok_s"]
                for row in rows.values():
                    row["batchgen_speedup"] = base / row["output_tok_s"]
                    row.update(agreement(row["token_ids"], rows["batchgen"]["token_ids"]))
                same = {hash_ids(r["token_ids"]) for r in rows.values()}
                report["mixed"][f"{size}_outputs_identical"] = len(same) == 1
            for row in rows.values():
                row.pop("token_ids")
            rounds.append(rows)
        report["mixed"][size] = rows  # the last round's
        report["rounds"][size] = [
            {peer: {k: r.get(k) for k in ROUND_KEYS} for peer, r in rows.items()} for rows in rounds
        ]
        if not args.skip_prefix and "batchgen" in rows:
            on, off = (
                run_child(model, "batchgen", "shared-prefix", n, VOCAB[size], args.dtype,
                          enable_prefix_caching=caching, **engine)
                for caching in (True, False)
            )  # fmt: skip
            report["shared_prefix"][size] = {
                "on": on,
                "off": off,
                "speedup": off["wall_s"] / on["wall_s"],
            }


def print_table(report: dict) -> None:
    m = report["machine"]
    print(
        f"\n{m['affinity']} CPUs, {m['load']} CPU hogs beside each system; load average "
        f"{m['loadavg_before']:.1f} before, {m['loadavg_after']:.1f} after"
    )
    print(
        "\n| model | system | dtype | threads | output tok/s | prompt tok/s | peak RSS MB "
        "| batchgen speedup | matmul floor tok/s | share of floor | identical | token agreement |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, rows in report["mixed"].items():
        if not isinstance(rows, dict):
            continue
        for peer, r in rows.items():
            floor = "| - | - |"
            if "floor_share" in r:
                floor = f"| {r['matmul_floor_tok_s']:.1f} | {r['floor_share']:.0%} |"
            agree = f" {r.get('requests_identical', '-')} | {r.get('token_agreement', '-')} |"
            print(
                f"| {size} | {peer} | {r['dtype']} | {r['threads']} | {r['output_tok_s']:.1f} | "
                f"{r['prompt_tok_s']:.0f} | {r['peak_rss_mb']:.0f} | "
                f"{r.get('batchgen_speedup', float('nan')):.2f}x {floor}{agree}"
            )
    for size, sp in report["shared_prefix"].items():
        print(
            f"\nshared prefix ({size}): caching on {sp['on']['wall_s']:.2f}s, off {sp['off']['wall_s']:.2f}s,"
            f" speedup {sp['speedup']:.2f}x, hit rate {sp['on']['prefix_cache_hit_rate']}"
        )
    for size, rounds in report["rounds"].items():
        if len(rounds) < 2:
            continue
        for peer in rounds[0]:
            for key in ROUND_KEYS:
                values = [r[peer][key] for r in rounds if r[peer].get(key) is not None]
                if values and not (key == "batchgen_speedup" and peer == "batchgen"):
                    print(
                        f"{size} {peer} {key} over {len(values)} rounds: "
                        f"{min(values):.2f}..{max(values):.2f}"
                    )
    if "step_overhead" in report:
        o = report["step_overhead"]
        print(f"\nper-step CPU overhead at batch {o['batch']}: {o['ms_per_step']:.3f} ms")


if __name__ == "__main__":
    main()
