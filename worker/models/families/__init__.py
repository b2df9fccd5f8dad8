"""Every family batchgen runs natively; ``registry.py`` finds one by HF architecture."""

from batchgen.worker.models.families.cohere import COHERE
from batchgen.worker.models.families.gemma import GEMMA, GEMMA2, GEMMA3
from batchgen.worker.models.families.glm import GLM, GLM4
from batchgen.worker.models.families.gpt2 import GPT2, STARCODER2
from batchgen.worker.models.families.gpt_neox import GPT_NEOX, STABLELM
from batchgen.worker.models.families.granite import GRANITE
from batchgen.worker.models.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from batchgen.worker.models.families.olmo import EXAONE4, OLMO2, OLMO3
from batchgen.worker.models.families.phi import PHI, PHI3
from batchgen.worker.models.families.smollm3 import SMOLLM3
from batchgen.worker.models.family import Family

FAMILIES: tuple[Family, ...] = (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI, PHI3, GPT_NEOX, STABLELM,
    GRANITE, COHERE, OLMO2, OLMO3, EXAONE4, SMOLLM3, GLM, GLM4, GPT2, STARCODER2,
)  # fmt: skip

__all__ = ["FAMILIES"]
