"""batchgen's engine against HF transformers, side by side in one run.

    python benchmarks/engine_bench.py                 # tiny (N=64) and small (N=32), all peers
    python benchmarks/engine_bench.py --sizes tiny --peers batchgen,hf-continuous
    python benchmarks/engine_bench.py --sizes tiny --peers batchgen,batchgen-transformers

Workload "mixed" (seeded): prompts uniform 16..256 tokens, outputs 70% uniform
16..64 and 30% uniform 256..512, random token ids, greedy, EOS off. Peers: HF
generate on static batches of 16 (left padding), HF continuous batching with a
length per request, batchgen, and batchgen-transformers (batchgen's engine on
transformers' own modules, the backend for architectures batchgen has no code
for: beside batchgen it measures what the backend costs). Also: a
shared-prefix workload (512-token common prefix) with prefix caching on and
off, and batchgen's per-step CPU overhead with the model taken out. Every system runs in its own process (peak RSS is
its own) under torch.inference_mode; the machine should be otherwise idle.
Every process gets OMP_WAIT_POLICY=PASSIVE unless the environment sets it
(--omp-wait-policy unset leaves libgomp's default): on a machine shared with
other work, the default wait made each of torch's 2-thread matmuls of 4-64
rows take ~270 ms instead of 6-17 ms here, which measures the neighbours,
not the engines.

batchgen's row also gives its matmul floor: the output tokens over the time
of the run's matrix multiplies alone, timed at every step shape the run used
(benchmarks/matmul_floor.py), and the share of that floor the run reached.
Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"tiny": 64, "small": 32}  # requests per size
ROUND_KEYS = ("output_tok_s", "batchgen_speedup", "floor_share", "matmul_floor_tok_s")
VOCAB = {"tiny": 8192, "small": 32000}


def child(args: argparse.Namespace) -> None:
    """Runs one system on one workload in this process; prints one JSON line."""
    import torch

    from benchmarks.peers import PEERS
    from benchmarks.workloads import WORKLOADS

    torch.manual_seed(0)
    wl = WORKLOADS[args.workload](args.num_requests, args.vocab)
    kwargs = json.loads(args.engine_kwargs) if args.peer.startswith("batchgen") else {}
    with torch.inference_mode():
        result = PEERS[args.peer](Path(args.model), wl, **kwargs)
    ids = result.pop("token_ids")
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
        outputs_digest=hash_ids(ids),
    )
    print("RESULT " + json.dumps(result))


def hash_ids(ids: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def set_omp_wait_policy(policy: str) -> None:
    """For this process (torch is not imported yet) and the children it starts."""
    if policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", policy.upper())


def run_child(model: Path, peer: str, workload: str, n: int, vocab: int, **engine: Any) -> dict:
    cmd = [
        sys.executable, __file__, "--child", "--model", str(model), "--peer", peer,
        "--workload", workload, "--num-requests", str(n), "--vocab", str(vocab),
        "--engine-kwargs", json.dumps(engine),
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{peer} on {workload} failed:\n{out.stderr[-3000:]}")


def step_overhead(model: Path, batch: int = 64) -> dict:
    """Mean time of engine.step() with the model forward and logits replaced by
    constant tensors: scheduling, input preparation, sampling and bookkeeping."""
    import torch

    from batchgen.worker import Engine, SamplingParams
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
    p.add_argument("--arch", default="llama")
    p.add_argument("--models-dir", default=None, help="where toy checkpoints are written/reused")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument(
        "--rounds", type=int, default=1, help="run the peers side by side this many times"
    )
    p.add_argument("--omp-wait-policy", choices=("passive", "active", "unset"), default="passive")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
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

    set_omp_wait_policy(args.omp_wait_policy)
    from batchgen.toy import write_toy_checkpoint

    models = Path(args.models_dir or tempfile.mkdtemp(prefix="batchgen-bench-"))
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        "mixed": {}, "rounds": {}, "shared_prefix": {},
    }  # fmt: skip
    for size in args.sizes.split(","):
        model = models / f"{args.arch}-{size}"
        if not (model / "config.json").exists():
            write_toy_checkpoint(model, arch=args.arch, size=size)
        n = SIZES[size]
        rounds = []
        for _ in range(args.rounds):
            rows = {}
            for peer in args.peers.split(","):
                rows[peer] = run_child(model, peer, "mixed", n, VOCAB[size])
                print(
                    f"# {size} {peer}: {rows[peer]['output_tok_s']:.0f} output tok/s",
                    file=sys.stderr,
                )
            if "batchgen" in rows:
                base = rows["batchgen"]["output_tok_s"]
                for row in rows.values():
                    row["batchgen_speedup"] = base / row["output_tok_s"]
                same = {r["outputs_digest"] for r in rows.values()}
                report["mixed"][f"{size}_outputs_identical"] = len(same) == 1
            rounds.append(rows)
        report["mixed"][size] = rows  # the last round's
        report["rounds"][size] = [
            {peer: {k: r.get(k) for k in ROUND_KEYS} for peer, r in rows.items()} for rows in rounds
        ]
        if not args.skip_prefix and "batchgen" in rows:
            on = run_child(
                model, "batchgen", "shared-prefix", n, VOCAB[size], enable_prefix_caching=True
            )
            off = run_child(
                model, "batchgen", "shared-prefix", n, VOCAB[size], enable_prefix_caching=False
            )
            report["shared_prefix"][size] = {
                "on": on,
                "off": off,
                "speedup": off["wall_s"] / on["wall_s"],
            }
    tiny = models / f"{args.arch}-tiny"
    if tiny.exists():
        report["step_overhead"] = step_overhead(tiny)
    print(json.dumps(report, indent=2))
    print_table(report)


def print_table(report: dict) -> None:
    print(
        "\n| model | system | output tok/s | prompt tok/s | peak RSS MB | batchgen speedup "
        "| matmul floor tok/s | share of floor |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, rows in report["mixed"].items():
        if not isinstance(rows, dict):
            continue
        for peer, r in rows.items():
            floor = "| - | - |"
            if "floor_share" in r:
                floor = f"| {r['matmul_floor_tok_s']:.0f} | {r['floor_share']:.0%} |"
            print(
                f"| {size} | {peer} | {r['output_tok_s']:.0f} | {r['prompt_tok_s']:.0f} | "
                f"{r['peak_rss_mb']:.0f} | {r.get('batchgen_speedup', float('nan')):.2f}x {floor}"
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
