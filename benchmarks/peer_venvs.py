"""How engine_bench starts a peer engine: in the venv of its own that ``make bench-peers``
built under ``.venv-peers/`` (never batchgen's dependencies), running
benchmarks/peer_engines.py, with the environment the peer's own docs ask for."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_VENVS = {"vllm": "vllm", "llama.cpp": "llamacpp", "ct2": "ct2"}
PEER_ENGINES = REPO / "benchmarks" / "peer_engines.py"
# vLLM's CPU docs: tcmalloc preloaded; its KV cache in GiB
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu"}


def peer_command(
    name: str, args: list[str], env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run peer ``name`` on ``args``; SystemExit
    naming `make bench-peers` when its venv is not built."""
    python = REPO / ".venv-peers" / PEER_VENVS[name] / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no venv for {name} at {python.parent.parent}: run `make bench-peers`")
    if name == "vllm":
        env = {**env, **VLLM_ENV, "LD_PRELOAD": TCMALLOC}
    return [str(python), str(PEER_ENGINES), "--peer", name, *args], env
