"""What a batch's input file must hold beyond what submit's validator checks (which
accepts native lines, ignores ``body.model`` and allows either endpoint): OpenAI
batch lines only, each with the batch's endpoint as its url, a custom_id no other
line has, and one model (``body.model``) for the whole file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.intake.lines import read_lines

SHOWN_ERRORS = 20


@dataclass(slots=True)
class LineCheck:
    model: str = ""
    lines: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's errors.data items
    error_count: int = 0

    def add(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < SHOWN_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})


def check_batch_lines(path: str, endpoint: str) -> LineCheck:
    """Lines that do not parse as JSON objects are left to submit's validator."""
    out = LineCheck()
    seen: set[str] = set()
    model_line = 0
    with open(path, "rb") as src:
        for number, raw in read_lines(src):
            out.lines += 1
            if not isinstance(raw, bytes):
                continue  # too long: the validator says so
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if not isinstance(value, dict):
                continue
            if "custom_id" not in value:
                out.add("missing_required_parameter", "a batch line needs a custom_id "
                        '({"custom_id", "method", "url", "body"})', number, "custom_id")  # fmt: skip
                continue
            custom_id = value["custom_id"]
            if isinstance(custom_id, str):
                if custom_id in seen:
                    out.add("duplicate_custom_id", f"custom_id {custom_id[:100]!r} is used by an "
                            "earlier line; each must be unique", number, "custom_id")  # fmt: skip
                seen.add(custom_id)
            if value.get("url") != endpoint:
                out.add("invalid_url", f"the url of every line must be the batch's endpoint "
                        f"{endpoint}", number, "url")  # fmt: skip
            body = value.get("body")
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or not model:
                out.add("missing_required_parameter", "body.model must name the model",
                        number, "body.model")  # fmt: skip
            elif not out.model:
                out.model, model_line = model, number
            elif model != out.model:
                out.add("mismatched_model", f"body.model {model[:200]!r} differs from "
                        f"{out.model[:200]!r} on line {model_line}; one batch runs one model",
                        number, "body.model")  # fmt: skip
    return out
