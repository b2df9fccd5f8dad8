"""Incremental detokenization for stop strings.

Decoding the whole output at every token is quadratic; instead we decode a
short window of recent tokens and emit only text that is complete (a byte-level
BPE token may end in the middle of a UTF-8 character, which decodes to U+FFFD
until the next token arrives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class StopStringMatcher:
    """Tracks the text of one request's output and finds its stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.max_stop_len = max(len(s) for s in stop)
        self.text = ""
        self.prefix_offset = 0  # tokens before this are fully reflected in self.text
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, output_ids: list[int]) -> str | None:
        """Called after each new token; returns the text cut before the first
        stop string once one appears, else None."""
        window = output_ids[self.prefix_offset :]
        prefix_text = self._decode(output_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return None  # an incomplete character: wait for more tokens
        delta = new_text[len(prefix_text) :]
        # search only where a stop string could newly end
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        self.prefix_offset = self.read_offset
        self.read_offset = len(output_ids)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            return self.text[: min(hits)]
        return None

    def skip(self, output_ids: list[int]) -> None:
        """Starts after tokens generated elsewhere (a resumed request)."""
        self.text = self._decode(output_ids)
        self.prefix_offset = self.read_offset = len(output_ids)
