"""Every family batchgen runs natively; ``registry.py`` finds one by HF architecture."""

from batchgen.worker.models.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from batchgen.worker.models.families.gpt_oss import GPT_OSS
from batchgen.worker.models.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from batchgen.worker.models.families.llama_moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from batchgen.worker.models.family import Family

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE,
                                GPT_OSS, DEEPSEEK_V2, DEEPSEEK_V3)  # fmt: skip

__all__ = ["FAMILIES"]
