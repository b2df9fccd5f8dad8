"""The errors of the CLI and serve side: a click usage error shown as one line, an HTTP
error in OpenAI's shape (serve/openai_errors.py writes it), an upload past its limit."""

from __future__ import annotations

from typing import Any

import click


class OneLineUsageError(click.UsageError):
    """click's usage error as every user mistake is shown: one line on stderr, exit 2
    (click's own form is four lines of usage, a hint and the error)."""

    def __init__(self, original: click.UsageError) -> None:
        super().__init__(original.format_message(), original.ctx)

    def show(self, file: Any = None) -> None:
        names: list[str] = []
        ctx = self.ctx
        while ctx is not None:  # "batchgen cache", however it was started (python -m)
            names.append((ctx.info_name or "") if ctx.parent else "batchgen")
            ctx = ctx.parent
        path = " ".join(reversed(names)) or "batchgen"
        click.echo(f"batchgen: error: {self.message} (`{path} --help` says more)", err=True)


class APIError(Exception):
    """A request serve refuses: ``status`` and OpenAI's ``code`` and ``param``."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class UploadTooLarge(Exception):
    """An uploaded file grew past serve's limit while it was read (files_api answers 413)."""
