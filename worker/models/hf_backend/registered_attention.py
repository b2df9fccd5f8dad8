"""batchgen's paged attention, registered as a transformers attention implementation.

transformers' attention modules project, normalise and rotate q/k themselves,
then hand (query, key, value) to whatever function ``config._attn_implementation``
names in its registry. We register one function, ``ATTN_IMPLEMENTATION``, that
passes the call to the model which is running at the time (a context variable:
the registry is global, models are many): that model either records what the
call asks for (the probe at load time) or writes K/V into its paged cache and
runs the kernels over the step's flat token batch.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

import torch

ATTN_IMPLEMENTATION = "batchgen_paged"


class AttentionSink(Protocol):
    """What a model running through the registry does with one layer's attention call."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """query (1, H, T, D), key/value (1, Hk, T, D) -> (1, T, H, D)."""
        ...


ACTIVE: ContextVar[AttentionSink | None] = ContextVar("batchgen_attention", default=None)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer (the registry's signature)."""
    sink = ACTIVE.get()
    if sink is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} runs only inside batchgen's engine"
        )
    return sink.attend(module, query, key, value, attention_mask, kwargs), None


def register() -> None:
    """Makes ``ATTN_IMPLEMENTATION`` a name transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
