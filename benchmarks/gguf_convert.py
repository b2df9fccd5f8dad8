"""llama.cpp's own HF-to-GGUF converter script on a batchgen toy checkpoint.

    python benchmarks/gguf_convert.py DIR --outtype f32 --outfile OUT.gguf

Run with the llama.cpp peer's venv (``make bench-peers``), which holds the
converter taken from the llama-cpp-python source release it built
(``.venv-peers/llama.cpp-convert``, else ``$LLAMA_CPP_CONVERT``). The converter
names a BPE tokenizer's pre-tokenizer by hashing how it splits a test string and
refuses one it has not seen, as a toy's freshly trained tokenizer is: here it is
told "default". The benchmark feeds token ids, so the tokenizer only has to load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVERTER = Path(os.environ.get("LLAMA_CPP_CONVERT", REPO / ".venv-peers" / "llama.cpp-convert"))


def main() -> None:
    if not (CONVERTER / "convert_hf_to_gguf.py").exists():
        sys.exit(f"no llama.cpp converter in {CONVERTER}: run `make bench-peers`")
    sys.path[:0] = [str(CONVERTER), str(CONVERTER / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = [str(CONVERTER / "convert_hf_to_gguf.py"), *sys.argv[1:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
