"""`make demo`: a toy checkpoint, a small mixed-format prompts file, one
`batchgen run` end to end on the embedded Redis, and a look at the Parquet.

The checkpoint has random weights, so the text is gibberish; everything else
(validation, Redis streams, continuous batching, Parquet, finalize) is real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo"


def prompts() -> list[dict]:
    lines: list[dict] = [
        {"id": "fox", "prompt": "The quick brown fox", "max_tokens": 24},
        {
            "id": "poem",
            "prompt": "Write a short poem about the sea.",
            "temperature": 0.8,
            "seed": 7,
        },
        {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "stop", "prompt": "List three colours.", "max_tokens": 40, "stop": ["."]},
        {
            "custom_id": "openai-chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12},
        },
        {
            "custom_id": "openai-completion",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Summarise the following text", "max_tokens": 12},
        },
    ]
    lines += [
        {"prompt": f"Request number {i}: explain how a hash table works.", "metadata": {"n": i}}
        for i in range(20)
    ]
    return lines


def main() -> None:
    env = {**os.environ, "BATCHGEN_HOME": str(DEMO / "home"), "HF_HUB_OFFLINE": "1"}
    bin_dir = Path(sys.executable).parent
    batchgen = str(bin_dir / "batchgen")
    model = DEMO / "tiny"
    if not (model / "config.json").exists():
        subprocess.run([batchgen, "toy-model", str(model), "--arch", "llama"], check=True, env=env)
    data = DEMO / "prompts.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in prompts()))
    out = DEMO / "out.parquet"
    print(
        f"\n$ batchgen run {data.relative_to(REPO)} --model {model.relative_to(REPO)} "
        f"-o {out.relative_to(REPO)} --force"
    )
    subprocess.run(  # --force: the output of an earlier make demo is replaced
        [batchgen, "run", str(data), "--model", str(model), "-o", str(out), "--force",
         "--max-tokens", "32"],
        check=True, env=env,
    )  # fmt: skip

    import pyarrow.parquet as pq

    table = pq.read_table(out)
    print(f"\nwrote {out} ({table.num_rows} rows, one per input line, input order)")
    print(f"columns: {', '.join(table.column_names)}\n")
    for row in table.slice(0, 6).to_pylist():
        text = row["text"].replace("\n", " ")[:50]
        print(
            f"  {row['index']:>2}  {row['id']:<18} {row['finish_reason']:<7}"
            f" {row['completion_tokens']:>3} tokens  {text!r}"
        )
    print(
        "\n(random toy weights: the text is gibberish; point --model at a real checkpoint for real text)"
    )

    from batchgen.jobs.redis import embedded

    embedded.stop(DEMO / "home")  # the demo's private embedded Redis


if __name__ == "__main__":
    main()
