"""Constrained decoding with llguidance: compiled grammars, matchers, token masks.

A request with ``structured_output`` carries a matcher (its grammar state). Each
step, before sampling, the rows of constrained requests get a token bitmask
(filled in parallel by llguidance's executor, on a thread while the model runs)
and every token the grammar does not allow gets logit -inf. After sampling the
matcher consumes the token; when the grammar cannot go on, the request stops.

The matcher follows the output tokens only, so preemption by recompute, prefix
hits and chunked prefill leave it alone; a resumed request replays its tokens
into a fresh one.

A request whose job splits reasoning from answer is constrained in its answer alone
(as vLLM does): an ``AnswerGate`` watches its text, sampling stays free until the
reasoning parser's answer marker (``</think>``, harmony's final-message start), and
the matcher starts with the text after it. A request whose reasoning never ends is
never constrained.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchgen.jobs.schema.constraints import StructuredOutput, grammar_text
from batchgen.jobs.schema.reasoning import ReasoningParser
from batchgen.worker.engine.detokenizer import StopStringMatcher
from batchgen.worker.worker_errors import GrammarError

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from batchgen.worker.engine.request import EngineRequest

MAX_COMPILED = 256  # distinct grammars kept compiled per engine


class Grammars:
    """Compiled grammars by content hash; a request gets a copy of the compiled state.

    A job of 10M rows with one schema compiles it once per worker.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltokenizer: Any = None  # built on first use (~1 s for a large vocabulary)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.num_compiled = 0

    def matcher(self, constraint: StructuredOutput, replay: list[int] | None = None) -> LLMatcher:
        """A fresh matcher for ``constraint`` that has consumed ``replay`` (resumed tokens)."""
        compiled = self._compile(constraint)
        m = compiled.deep_copy()
        if replay and not m.consume_tokens(replay):
            raise GrammarError(f"the resumed tokens do not follow the constraint: {m.get_error()}")
        return m

    def answer_matcher(self, constraint: StructuredOutput, answer: str) -> LLMatcher:
        """A fresh matcher for ``constraint`` that has consumed ``answer``, the text an
        ``AnswerGate`` found after the reasoning (usually none)."""
        tokens = self._hf_tokenizer.encode(answer, add_special_tokens=False) if answer else []
        return self.matcher(constraint, tokens)

    def _compile(self, constraint: StructuredOutput) -> LLMatcher:
        key = constraint.key
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            return found
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer(), grammar_text(constraint.spec), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        self._compiled[key] = m
        self.num_compiled += 1
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return m

    def _tokenizer(self) -> Any:
        if self._lltokenizer is None:
            try:
                self._lltokenizer = grammar_tokenizer(
                    self._hf_tokenizer, self._vocab_size, self._eos
                )
            except (ValueError, TypeError) as exc:  # e.g. a slow (Python) tokenizer
                raise GrammarError(f"this model's tokenizer cannot be constrained: {exc}") from None
        return self._lltokenizer


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    """llguidance's view of ``hf_tokenizer``: each token's bytes, with an added token
    that is not special (Qwen's ``<tool_call>``, ``<think>``) as the text it decodes to.

    llguidance reads every added token as a special one (text no grammar literal
    matches), yet tokenizes a literal's ``<tool_call>`` text to that token and lets the
    mask allow it: the matcher then refused the token and the request was aborted.
    Here only the tokenizer's special tokens are special.
    """
    import llguidance.hf
    from llguidance import LLTokenizer, TokenizerWrapper

    read = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    text = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if not t.special}
    if not text:
        return read
    special = b"\xff"  # llguidance's marker of a special token's bytes
    tokens = [(b"" if i in text or not read.is_special_token(i) else special)
              + read.decode_bytes([i]) for i in range(vocab_size)]  # fmt: skip

    class Vocabulary:
        eos_token_id, bos_token_id = (eos[0] if eos else None), None

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: str) -> list[int]:
            return list(hf_tokenizer.encode(s, add_special_tokens=False))

    return LLTokenizer(TokenizerWrapper(Vocabulary()), n_vocab=vocab_size, eos_token=eos)


class AnswerGate:
    """Holds a request's constraint back while it reasons: finds the reasoning parser's
    answer marker in the output's text, decoded as the parser reads it."""

    def __init__(self, tokenizer: Any, reasoning: ReasoningParser) -> None:
        self.marker = reasoning.answer_marker
        self._text = StopStringMatcher(tokenizer, [self.marker], not reasoning.keeps_special)

    def feed(self, output_ids: list[int]) -> str | None:
        """Called after each new token: None while the reasoning goes on, then the
        answer's text so far (what follows the marker; usually "")."""
        before = self._text.feed(output_ids)
        return None if before is None else self._text.text[len(before) + len(self.marker) :]

    def skip(self, output_ids: list[int]) -> str | None:
        """Starts after tokens generated elsewhere (a resumed request): ``feed``'s answer
        when they already ended the reasoning."""
        self._text.skip(output_ids)
        at = self._text.text.find(self.marker)
        return None if at < 0 else self._text.text[at + len(self.marker) :]


class TokenMasks:
    """Fills the disallowed-token masks of a step's constrained rows off the main thread.

    llguidance writes one bit per token; the thread also unpacks the bits, so all
    the step itself does is one ``masked_fill_`` over the logits.
    """

    def __init__(self, vocab_size: int, pinned: bool = False) -> None:
        self.vocab_size = vocab_size  # the logits' width (the model's vocabulary)
        self.pinned = pinned  # masks in pinned memory: their copy to a CUDA device is queued
        self.words = (vocab_size + 31) // 32
        self._executor: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        self.fill_seconds = 0.0  # spent filling masks (on the thread)
        self.wait_seconds = 0.0  # of that, what the step waited for after the model ran

    def start(self, requests: list[EngineRequest]) -> Future[torch.Tensor] | None:
        """Begins the masks of ``requests`` (rows in that order; None: none is constrained)."""
        rows = [(r.matcher, i) for i, r in enumerate(requests) if r.matcher is not None]
        if not rows:
            return None
        return self._thread.submit(self._fill, rows, len(requests))

    def wait(self, pending: Future[torch.Tensor], device: torch.device) -> torch.Tensor:
        """(rows, vocab) bool on ``device``: True where a token is not allowed."""
        start = time.perf_counter()
        masks = pending.result()
        self.wait_seconds += time.perf_counter() - start
        return masks.to(device, non_blocking=True)

    def _fill(self, rows: list[tuple[LLMatcher, int]], num_rows: int) -> torch.Tensor:
        from llguidance import LLExecutor

        start = time.perf_counter()
        if self._executor is None:
            self._executor = LLExecutor()
        bits = np.full((num_rows, self.words), -1, dtype=np.int32)  # unconstrained: all allowed
        self._executor.unsafe_compute_mask_ptr(rows, bits.ctypes.data, self.words * 4, num_rows)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        disallowed = torch.empty((num_rows, self.vocab_size), dtype=torch.bool,
                                 pin_memory=self.pinned)  # fmt: skip
        np.equal(allowed[:, : self.vocab_size], 0, out=disallowed.numpy())
        self.fill_seconds += time.perf_counter() - start
        return disallowed


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Sets the logits of disallowed tokens (``TokenMasks.wait``) to -inf."""
    logits.masked_fill_(masks, float("-inf"))
