"""A byte-level BPE tokenizer trained in about a second on built-in text."""

from __future__ import annotations

import random
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML, the template Qwen and many others use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A batch of prompts goes in, one
row per prompt comes out. Workers pull requests from a stream, run them on the
GPU with continuous batching, and write the results to Parquet files. When a
worker dies, another one picks up its work; nothing is lost and nothing is
written twice. Write a short poem about the sea. Summarise the following text
in one sentence. What is the capital of France? Translate this sentence into
German. Explain how a hash table works to a ten year old. List three colours.
The weather today is sunny with a light breeze from the west, and tomorrow
there will be rain in the morning and clouds in the afternoon.
"""

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")


def _corpus(num_lines: int, seed: int) -> list[str]:
    """English sentences plus seeded pseudo-words, enough for any vocab up to ~40k."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(60_000)
    ]
    lines = ENGLISH.split("\n") * 50
    for _ in range(num_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(12)) + ".")
    return lines


def train_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int, seed: int = 0) -> None:
    """Trains a byte-level BPE of exactly ``vocab_size`` tokens and saves it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(num_lines=vocab_size * 12, seed=seed), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"toy tokenizer trained to {tok.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
