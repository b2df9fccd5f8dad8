"""fbgemm FP8 tiny checkpoints (``quant_method: fbgemm_fp8``) and transformers' own model of them.

``quantize_fbgemm_fp8(src, out, ...)`` writes what transformers'
``FbgemmFp8Config`` saves: every ``nn.Linear`` transformers converts becomes
``NAME.weight`` float8_e4m3fn (out, in) and ``NAME.weight_scale`` fp32 (out, 1),
quantized per row as fbgemm's ``quantize_fp8_per_row`` does (``fp8_per_row``);
modules in ``modules_to_not_convert`` stay as they are.

``fbgemm_reference(path, monkeypatch)`` is transformers' own loader and
``FbgemmFp8Linear`` forward on the CPU. transformers refuses fbgemm without a
GPU and fbgemm-gpu (CUDA only), so the test patches in, for the two CUDA ops
its forward calls, their definitions in plain torch (fbgemm's quantize.cu):
``quantize_fp8_per_row`` (scale = max(min(row amax, ub) / 448, 1 / (448 *
512)), x / scale saturated to e4m3) and ``f8f8bf16_rowwise`` (the e4m3
product times both scales; kept in fp32 here, where the kernel rounds to bf16,
so the comparison is at fp32); and keeps the fp32 dtype transformers would
overwrite with bf16.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.quant_checkpoints import _rewrite

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
LINEAR = re.compile(r"(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj|lm_head)\.weight$")


def fp8_per_row(
    x: torch.Tensor, bs: Any = None, scale_ub: torch.Tensor | None = None, output_dtype: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's ``quantize_fp8_per_row``: (rows, k) -> (e4m3 (rows, k), fp32 scales (rows,))."""
    top = x.float().abs().amax(dim=-1)
    if scale_ub is not None:
        top = torch.minimum(top, scale_ub.float())
    scale = torch.maximum(top / FP8_MAX, torch.tensor(MIN_SCALE))
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def f8f8_rowwise(
    xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
    use_fast_accum: bool = True,
) -> torch.Tensor:  # fmt: skip
    """fbgemm's ``f8f8bf16_rowwise``: (xq @ wq^T) x each row's and each channel's scale."""
    return (xq.float() @ wq.float().t()) * x_scale[:, None] * w_scale.reshape(1, -1)


def quantize_fbgemm_fp8(
    src: Path, out: Path, skip: list[str] | None = None, bound: float | None = None
) -> Path:
    """``skip``: modules_to_not_convert as written (None: absent, so transformers keeps the
    LM head plain); ``bound``: activation_scale_ub (None: absent, FbgemmFp8Config's 1200)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = ["lm_head"] if skip is None else skip

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if not LINEAR.match(name) or not should_convert_module(module, kept):
            return {name: tensor}
        q, scale = fp8_per_row(tensor.float())
        return {name: q, f"{module}.weight_scale": scale.reshape(-1, 1)}

    config: dict[str, Any] = {"quant_method": "fbgemm_fp8"}
    if bound is not None:
        config["activation_scale_ub"] = bound
    if skip is not None:
        config["modules_to_not_convert"] = skip
    return _rewrite(src, out, convert, config)


def fbgemm_reference(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import fbgemm_fp8
    from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer

    monkeypatch.setattr(FbgemmFp8HfQuantizer, "validate_environment", lambda *a, **k: None)
    monkeypatch.setattr(FbgemmFp8HfQuantizer, "update_dtype", lambda self, dtype: dtype)
    monkeypatch.setattr(fbgemm_fp8, "get_quantize_fp8_per_row", lambda: fp8_per_row)
    monkeypatch.setattr(torch.ops.fbgemm, "f8f8bf16_rowwise", f8f8_rowwise, raising=False)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    converted = [m for m in model.modules() if isinstance(m, fbgemm_fp8.FbgemmFp8Linear)]
    assert converted and all(m.weight.dtype == torch.float8_e4m3fn for m in converted)
    return model
