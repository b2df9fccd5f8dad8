"""Every family batchgen runs natively; ``registry.py`` finds one by HF architecture."""

from batchgen.worker.models.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from batchgen.worker.models.family import Family

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3)

__all__ = ["FAMILIES"]
