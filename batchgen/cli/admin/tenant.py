"""``batchgen tenant set|list``: tenants' weights, quotas and usage."""

from __future__ import annotations

import json

import click

from batchgen.cli._common import connect, handles_errors, redis_option


def _limit(raw: str | None) -> int | None:
    """A quota flag: a count, or ``none`` for no limit."""
    if raw is None or raw.lower() == "none":
        return None
    try:
        value = int(raw.replace("_", "").replace(",", ""))
    except ValueError:
        raise click.BadParameter(f"{raw!r}: give a whole number, or 'none'") from None
    return value


@click.group("tenant")
def tenant() -> None:
    """Tenants share a model's workers by weight, within a priority class, and are held
    to their quotas: a submit that would take a tenant past one is refused before
    anything is queued. A tenant without settings has weight 1 and no limits.

    A job's tenant: submit --tenant, else $BATCHGEN_TENANT, else your login name;
    batchgen serve sets the API key's tenant.
    """


@tenant.command("set")
@click.argument("name")
@click.option(
    "--weight",
    type=float,
    default=None,
    help="Its share against other tenants, from 0.001 to 1000 (1).",
)
@click.option("--max-enqueued-tokens", "max_tokens", metavar="N|none", default=None,
              help="Estimated input tokens its unfinished jobs may hold together.")  # fmt: skip
@click.option("--max-jobs", metavar="N|none", default=None, help="Unfinished jobs at once.")
@click.option("--max-priority", metavar="N|none", default=None,
              help="The highest --priority class its jobs may ask for (none: serve keys the "
              "normal class 0, the CLI and admin keys any).")  # fmt: skip
@redis_option
@handles_errors
def set_tenant(
    name: str, weight: float | None, max_tokens: str | None, max_jobs: str | None,
    max_priority: str | None, redis_url: str | None,
) -> None:  # fmt: skip
    """Set NAME's weight, quotas and highest priority class (the ones given; the others
    stay)."""
    from batchgen.jobs.ops.fair_share import tenants
    from batchgen.jobs.ops.fair_share.schedule import check_tenant

    conn, keys, _ = connect(redis_url)
    settings = tenants.load(conn, keys, check_tenant(name))
    if weight is not None:
        settings.weight = weight
    if max_tokens is not None:
        settings.max_enqueued_tokens = _limit(max_tokens)
    if max_jobs is not None:
        settings.max_jobs = _limit(max_jobs)
    if max_priority is not None:
        settings.max_priority = _limit(max_priority)
    tenants.save(conn, keys, settings)
    click.echo(
        f"tenant {name}: weight {settings.weight:g}, max enqueued tokens "
        f"{settings.max_enqueued_tokens if settings.max_enqueued_tokens is not None else 'none'}, "
        f"max jobs {settings.max_jobs if settings.max_jobs is not None else 'none'}, "
        f"max priority {settings.max_priority if settings.max_priority is not None else 'none'}"
    )


@tenant.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@redis_option
@handles_errors
def list_tenants(as_json: bool, redis_url: str | None) -> None:
    """Every tenant: weight, quotas and what its unfinished jobs hold of them, usage."""
    from batchgen.jobs.ops.usage import tenants_report

    conn, keys, _ = connect(redis_url)
    report = tenants_report(conn, keys)
    if as_json:
        click.echo(json.dumps(report))
        return
    if not report:
        click.echo("no tenants")
        return
    click.echo(f"{'TENANT':<16} {'WEIGHT':>6} {'MAX PRIO':>8} {'JOBS':>9} {'ENQUEUED TOK':>17} "
               f"{'IN TOK':>9} "
               f"{'CACHED':>9} {'OUT TOK':>9} {'ENGINE S':>9}")  # fmt: skip
    for t in report:
        jobs = f"{t['jobs']}/{t['max_jobs'] if t['max_jobs'] is not None else '-'}"
        limit = t["max_enqueued_tokens"]
        enqueued = f"{t['enqueued_tokens']}/{limit if limit is not None else '-'}"
        u = t["usage"]
        top = t["max_priority"] if t["max_priority"] is not None else "-"
        click.echo(f"{t['tenant'] or '(none)':<16} {t['weight']:>6g} {top:>8} {jobs:>9} "
                   f"{enqueued:>17} "
                   f"{u['input_tokens']:>9} {u['cached_input_tokens']:>9} "
                   f"{u['output_tokens']:>9} {u['engine_s']:>9.1f}")  # fmt: skip
