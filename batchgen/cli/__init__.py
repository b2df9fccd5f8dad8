"""The ``batchgen`` command line.

Each command lives in its own module and is imported only when it runs, so
``batchgen status`` never pays for importing torch.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

import click

from batchgen import __version__
from batchgen.interface_errors import OneLineUsageError

# command name -> "module:attribute"; each later feature adds its line here.
COMMANDS: dict[str, str] = {
    "toy-model": "batchgen.cli.admin.toy_model:toy_model",
    "submit": "batchgen.cli.submit:submit",
    "status": "batchgen.cli.status:status",
    "jobs": "batchgen.cli.jobs:jobs",
    "cancel": "batchgen.cli.cancel:cancel",
    "delete": "batchgen.cli.delete:delete",
    "finalize": "batchgen.cli.finalize:finalize",
    "retry": "batchgen.cli.retry:retry",
    "download": "batchgen.cli.download:download",
    "worker": "batchgen.cli.worker:worker",
    "run": "batchgen.cli.run:run",
    "serve": "batchgen.cli.serve:serve",
    "cache": "batchgen.cli.admin.cache:cache",
    "redis": "batchgen.cli.admin.redis_command:redis_group",
    "tenant": "batchgen.cli.admin.tenant:tenant",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except OneLineUsageError:
            raise
        except click.UsageError as exc:
            raise OneLineUsageError(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OneLineUsageError:
            raise
        except click.UsageError as exc:  # a subcommand's flags, arguments or checks
            raise OneLineUsageError(exc) from None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise click.UsageError(f"No such command {name!r}.{hint}", ctx)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy_commands.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command), target
        return command


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="batchgen")
def main() -> None:
    """batchgen: batch LLM inference that never loses a row.

    Submit a JSONL file of prompts to Redis streams, run GPU (or CPU) workers
    that generate with continuous batching over a paged KV cache, and download
    one Parquet row per input line.

    \b
    Quick start on one machine (embedded Redis, nothing else to install):
      batchgen toy-model ./tiny --arch llama --size tiny
      batchgen run prompts.jsonl --model ./tiny -o out.parquet
    """
