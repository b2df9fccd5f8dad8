"""Shared CLI pieces: the --redis option, sampling flags, and one-line errors."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from batchgen.jobs.ops.job_record import JobRecord

REDIS_HELP = (
    "Redis URL (redis://, rediss://, unix://, redis+sentinel://HOST:PORT,.../SERVICE/DB); "
    "default $BATCHGEN_REDIS_URL, else the "
    "embedded server shared by every batchgen command on this machine."
)


def redis_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--redis", "redis_url", metavar="URL", default=None, help=REDIS_HELP,
                        callback=_hide_password)(func)  # fmt: skip


def model_impl_option(func: Callable[..., Any]) -> Callable[..., Any]:
    from batchgen.worker.engine_config import MODEL_IMPLS

    return click.option(
        "--model-impl", type=click.Choice(MODEL_IMPLS), default="auto", show_default=True,
        help="native: batchgen's own model code; transformers: the checkpoint's transformers "
        "modules with batchgen's paged attention; auto: native when batchgen has the "
        "architecture, else transformers.",
    )(func)  # fmt: skip


def quantization_option(func: Callable[..., Any]) -> Callable[..., Any]:
    from batchgen.worker.engine_config import QUANTIZATIONS

    return click.option(
        "--quantization", metavar="|".join(QUANTIZATIONS), default=None,
        help="fp8: quantize an unquantized (bf16/fp16/fp32) checkpoint's decoder projections to "
        "FP8 e4m3 as it loads (per-channel weight scales, dynamic per-token activations; about "
        "half their bf16 memory, not exact: docs/models.md). int8: the same in int8, multiplied "
        "in int8 (W8A8; CPU only). Default: the checkpoint as stored.",
    )(func)  # fmt: skip


def threads_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--threads", type=int, default=None,
        help="CPU threads of each engine process (torch's and the decode attention's). "
        "Default: the CPUs this process may use (its affinity mask and cgroup CPU quota, not "
        "the host's core count), shared among worker --workers; OMP_NUM_THREADS caps it.",
    )(func)  # fmt: skip


def _hide_password(_ctx: click.Context, _param: click.Parameter, url: str | None) -> str | None:
    """Others can read our command line (ps) for as long as a worker runs: blank the password."""
    if url:
        from batchgen.jobs.redis.connection import hide_password_from_ps

        hide_password_from_ps(url)
    return url


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
STRUCTURED_FLAGS = ("json_schema", "regex", "choice", "grammar")


def sampling_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Job-level sampling defaults; a line's own fields override them.

    The command receives them checked, as one ``defaults`` dict (``jobs.params``).
    """
    options = [
        click.option(
            "--max-tokens",
            type=int,
            default=None,
            help="For lines without their own. Default: 16 for a prompt; a chat line runs to "
            "the end of its answer or the context.",
        ),
        click.option("--temperature", type=float, default=None, help="Default 0 (greedy)."),
        click.option("--top-p", type=float, default=None, help="In (0, 1]; default 1."),
        click.option("--top-k", type=int, default=None, help="0 turns it off (default)."),
        click.option("--seed", type=int, default=None, help="Per-request sampling seed."),
        click.option(
            "--stop", multiple=True, metavar="STR", help="Stop string (repeat for several)."
        ),
        click.option(
            "--json-schema",
            type=click.Path(exists=True, dir_okay=False),
            metavar="FILE",
            help="Every output is JSON valid for this JSON Schema (a line's own "
            "structured_output or response_format overrides it).",
        ),
        click.option("--regex", metavar="RE", help="Every output matches this regex."),
        click.option(
            "--choice",
            multiple=True,
            metavar="STR",
            help="Every output is one of these strings "
            "(repeat the flag: --choice yes --choice no).",
        ),
        click.option(
            "--grammar",
            type=click.Path(exists=True, dir_okay=False),
            metavar="FILE",
            help="Every output follows this Lark grammar (llguidance's dialect; see docs/structured-output.md).",
        ),
        click.option(
            "--chat-template-kwargs",
            metavar="JSON",
            default=None,
            help="Variables for the chat template of every chat line, e.g. "
            "'{\"enable_thinking\": false}' (a line's own chat_template_kwargs win).",
        ),
        click.option(
            "--reasoning-parser",
            metavar="NAME",
            default=None,
            help="Split each output into reasoning and answer: qwen3, deepseek_r1, gpt_oss, think, "
            "think:START,END, or none. Default: the one the checkpoint's chat template makes "
            "unambiguous (none when it has no think tags).",
        ),
        click.option(
            "--tool-call-parser",
            metavar="NAME",
            default=None,
            help="Find the tool calls of tool_choice auto rows: hermes, llama3_json, mistral, "
            "openai (gpt-oss), or none. Default: the one the checkpoint's chat template makes unambiguous.",
        ),
    ]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in SAMPLING_FLAGS}
        flags["structured_output"] = _structured_flag({n: kwargs.pop(n) for n in STRUCTURED_FLAGS})
        defaults = job_defaults(flags)
        template_kwargs = kwargs.pop("chat_template_kwargs")
        if template_kwargs is not None:
            defaults["chat_template_kwargs"] = _template_kwargs_flag(template_kwargs)
        return func(*args, defaults=defaults, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def table_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """How a Parquet or CSV input's rows become requests; the command receives them as
    one ``table`` (``jobs.tables.TableSpec``)."""
    options = [
        click.option("--prompt-column", metavar="COL", default=None,
                     help="Table input: the column holding each row's prompt."),
        click.option("--messages-column", metavar="COL", default=None,
                     help="Table input: the column holding each row's chat, a list of "
                     "{role, content}."),
        click.option("--template", default=None,
                     help='Table input: the prompt made from columns, e.g. "Summarise: '
                     '{title}\\n{body}" (\\n: a newline; {{ and }}: literal braces; values '
                     "are inserted as they are)."),
        click.option("--id-column", metavar="COL", default=None,
                     help="Table input: the column holding each row's id (default: the row "
                     "number)."),
        click.option("--keep-columns", metavar="A,B|all", default=None,
                     help="Table input: columns to put in result.parquet after the "
                     "generation columns, with their types ('all': every column)."),
        click.option("--sampling-columns", metavar="FIELD[=COL],...", default=None,
                     help="Table input: columns that set a sampling field per row, e.g. "
                     "max_tokens,temperature=temp (the column temp sets temperature). "
                     "Other columns are data, whatever their names."),
    ]  # fmt: skip

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from batchgen.jobs.intake.table_spec import TableSpec, parse_sampling_columns

        names = ("prompt_column", "messages_column", "template", "id_column")
        flags = {name: kwargs.pop(name) for name in names}
        with user_errors():
            keep = _keep_columns(kwargs.pop("keep_columns"))
            sampling = parse_sampling_columns(kwargs.pop("sampling_columns"))
        spec = TableSpec(**flags, keep_columns=keep, sampling_columns=sampling)
        return func(*args, table=spec, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def _keep_columns(value: str | None) -> tuple[str, ...]:
    from batchgen.jobs.schema.errors import UsageError

    if value is None:
        return ()
    names = tuple(name.strip() for name in value.split(","))
    if not all(names):
        raise UsageError(f"--keep-columns {value!r}: an empty column name")
    if "all" in names and len(names) > 1:
        raise UsageError("--keep-columns: 'all' keeps every column; give it alone")
    return names


def job_defaults(flags: dict[str, Any]) -> dict[str, Any]:
    from batchgen.jobs.schema.errors import ParamError
    from batchgen.jobs.schema.sampling import check_together, job_defaults

    try:
        defaults = job_defaults(flags)
        check_together(defaults)
        return defaults
    except ParamError as exc:
        raise click.UsageError(str(exc)) from None


def _template_kwargs_flag(value: str) -> dict[str, Any]:
    """--chat-template-kwargs JSON, checked."""
    from batchgen.jobs.schema import chat_template

    try:
        return chat_template.check(json.loads(value))
    except ValueError as exc:  # not JSON, or ParamError
        raise click.UsageError(f"--chat-template-kwargs: {exc}") from None


def _structured_flag(flags: dict[str, Any]) -> dict[str, Any] | None:
    """--json-schema/--regex/--choice/--grammar as one structured_output spec (None: none)."""
    given = {name: value for name, value in flags.items() if value}
    if len(given) > 1:
        shown = " and ".join("--" + name.replace("_", "-") for name in given)
        raise click.UsageError(f"{shown}: give at most one output constraint")
    if not given:
        return None
    name, value = next(iter(given.items()))
    flag = "--" + name.replace("_", "-")
    if name == "choice":
        return _checked_spec(flag, {"choice": list(value)})
    if name == "regex":
        return _checked_spec(flag, {"regex": value})
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"{flag} {value}: cannot read it ({exc})") from None
    if name == "grammar":
        return _checked_spec(flag, {"grammar": text})
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise click.UsageError(f"{flag} {value}: not valid JSON ({exc})") from None
    return _checked_spec(flag, {"json": schema})


def _checked_spec(flag: str, spec: dict[str, Any]) -> dict[str, Any]:
    from batchgen.jobs.schema.constraints import check_spec
    from batchgen.jobs.schema.errors import ParamError

    try:
        return check_spec(spec)
    except ParamError as exc:
        raise click.UsageError(f"{flag}: {exc}") from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Named errors and unreachable Redis become one line on stderr and an exit code."""
    import redis

    from batchgen.jobs.redis.connection import describe_connection_error
    from batchgen.jobs.schema.errors import BatchgenError

    try:
        yield
    except BatchgenError as exc:
        click.echo(f"batchgen: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        click.echo(f"batchgen: error: {describe_connection_error(exc)}", err=True)
        sys.exit(1)


def handles_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with user_errors():
            return func(*args, **kwargs)

    return wrapper


def report_submit(result: Any) -> None:
    """What submit (or run) says on stderr about its input: the lines it skipped (their
    rows are errors), and ids that repeat (allowed: rows are told apart by index)."""
    unit = result.unit
    if result.skipped:
        click.echo(f"skipped {result.skipped} invalid {unit}(s), each an error row:", err=True)
        for error in result.errors:
            click.echo(f"  {error}", err=True)
        if result.skipped > len(result.errors):
            click.echo(f"  ... and {result.skipped - len(result.errors)} more", err=True)
    repeats = result.duplicates
    if repeats.count:
        first, again = repeats.first
        click.echo(
            f"batchgen: warning: {repeats.count} {unit}(s) repeat the id of an earlier {unit} "
            f"({unit} {again} has the id of {unit} {first}); each still has its own row, told "
            "apart by index",
            err=True,
        )


def connect(redis_url: str | None):
    """(client, keys, target) for a command."""
    from batchgen.jobs.environment import REDIS_WAIT
    from batchgen.jobs.redis.connection import connect, resolve
    from batchgen.jobs.redis.keys import Keys

    target = resolve(redis_url)
    return connect(target.url, wait_s=REDIS_WAIT.get()), Keys.from_env(), target


def progress_bar(record: JobRecord, width: int = 30) -> str:
    """A job's rows: ``#`` done, ``x`` failed (error rows), ``-`` cancelled, ``.`` not
    yet; the count is of done rows. A job cancelled whole is a bar of ``-`` and
    0/total, never a full bar beside "done 0"."""
    total = record.total
    marks = [("#", record.done), ("x", record.errors), ("-", record.cancelled_rows)]
    bar, rows = "", 0
    for mark, n in marks:
        rows += n
        filled = int(width * rows / total) if total else 0
        bar += mark * (filled - len(bar))
    return "[" + bar + "." * (width - len(bar)) + f"] {record.done}/{total} done"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
