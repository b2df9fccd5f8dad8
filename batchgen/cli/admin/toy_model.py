"""``batchgen toy-model``: write a random-initialised checkpoint for tests and demos."""

from __future__ import annotations

import click

from batchgen.toy import ARCHS, MOE_ARCHS, SIZES


@click.command("toy-model")
@click.argument("out_dir", type=click.Path(file_okay=False, writable=True))
@click.option("--arch", type=click.Choice(ARCHS + MOE_ARCHS), default="llama", show_default=True)
@click.option("--size", type=click.Choice(list(SIZES)), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
)
@click.option(
    "--max-shard-size",
    default=None,
    help="Split the weights into safetensors shards of at most this size (e.g. 5MB).",
)
def toy_model(
    out_dir: str, arch: str, size: str, seed: int, dtype: str, max_shard_size: str | None
) -> None:
    """Write a toy HF-format checkpoint (random weights) to OUT_DIR.

    The checkpoint has config.json, model.safetensors, generation_config.json
    and a byte-level BPE tokenizer with a chat template; transformers loads it
    offline. Its weights are random, so its text is gibberish: it is for
    testing pipelines and measuring speed. For real work, point --model at a
    real checkpoint directory.

    \b
    Sizes: tiny ≈ 6M parameters (hidden 256, 4 layers, vocab 8192),
           small ≈ 100M parameters (hidden 768, 12 layers, vocab 32000).
    qwen3_moe: 16 experts, 4 per token, each a quarter of the dense MLP.
    """
    from batchgen.toy import write_toy_checkpoint

    path = write_toy_checkpoint(
        out_dir, arch=arch, size=size, seed=seed, dtype=dtype, max_shard_size=max_shard_size
    )
    click.echo(f"wrote {arch} {size} toy checkpoint (random weights) to {path}")
