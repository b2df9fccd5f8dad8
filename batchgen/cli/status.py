"""``batchgen status``: a job's (or every job's) progress."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime

import click

from batchgen.cli._common import connect, duration, handles_errors, progress_bar, redis_option


def _render(s) -> str:
    d = s.to_dict()
    if d["retry_incomplete"]:
        note = f"  [retry incomplete: `batchgen retry {d['job_id']}` queues the rest]"
    else:
        note = "  [submit incomplete]" if d["submit_incomplete"] else ""
    if d["refused_now"]:
        note += "  [refused: no worker holding its weights runs it]"
    lines = [
        f"job        {d['job_id']}  ({d['model']})",
        f"state      {d['state']}" + note,
        f"progress   {progress_bar(s.record)}",
        *_counts(d),
        f"tokens     in {d['prompt_tokens']}, out {d['completion_tokens']}, "
        f"cached {d['cached_tokens']}; {d['tokens_per_s']} tok/s",
        f"eta        {_eta(d)}",
        f"workers    {d['live_workers']} live"
        + (f": {', '.join(d['workers'])}" if d["workers"] else ""),
        f"output     {d['output']}",
        f"created    {datetime.fromtimestamp(d['created_at']).isoformat(timespec='seconds')}",
    ]
    if d["reasoning_parser"]:
        lines.append(
            f"reasoning  {d['reasoning_parser']} parser; {d['reasoning_tokens']} of the out "
            "tokens reasoned"
        )
    if d["tool_call_parser"]:
        lines.append(
            f"tools      {d['tool_call_parser']} parser: tool_calls of tool_choice auto rows"
        )
    lines += _fair_share_lines(d)
    if d["retry_rounds"]:
        lines.append(f"retried    {d['retried']} rows in {d['retry_rounds']} retry round(s)")
    if d["error"]:
        lines.append(f"error      {d['error']}")
    if d["storage_error"]:
        lines.append(f"storage    {d['storage_error']}")
    if d["refused"]:
        lines.append(f"refused    {d['refused']}")
    return "\n".join(lines)


def _counts(d: dict) -> list[str]:
    """The rows made so far and the requests still to make, each line short enough for
    an 80-column terminal at a billion rows."""
    lines = [
        f"rows       done {d['done']}, failed {d['failed']}, cancelled {d['cancelled']}",
        f"requests   in flight {d['in_flight']}, queued {d['queued']}",
    ]
    if d["skipped_invalid"]:
        lines.append(f"invalid    {d['skipped_invalid']} input lines, error rows (--skip-invalid)")
    return lines


def _eta(d: dict) -> str:
    if d["unserved"]:
        return "- (no live worker serves the model)"
    if d["refused_now"]:
        return "- (refused by the live workers: see refused)"
    if d["eta_s"] is None and d["state"] in ("queued", "running"):
        if d["done"] + d["failed"] == 0:
            return "- (no row finished yet)"
        return "- (nothing made in the last minute)"
    return duration(d["eta_s"])


def _fair_share_lines(d) -> list[str]:
    """The job's tenant and class, where it stands against its deadline, its usage."""
    from batchgen.jobs.ops.fair_share.deadlines import describe

    u = d["usage"]
    lines = [
        f"tenant     {d['tenant'] or '(none)'}, priority {d['priority']}",
        f"usage      in {u['input_tokens']} tokens ({u['cached_input_tokens']} cached), out "
        f"{u['output_tokens']}, engine {u['engine_s']:.1f}s"
        + (
            f"; failed requests' input {u['failed_input_tokens']} (not billed)"
            if u["failed_input_tokens"]
            else ""
        ),
    ]
    if d["deadline"]:
        lines.append(f"deadline   {describe(d['deadline'])}")
    return lines


def _table(statuses) -> str:
    if not statuses:
        return "no jobs"
    out = [f"{'JOB':<28} {'STATE':<11} {'PROGRESS':<44} {'TOK/S':>8} {'ETA':>7}"]
    for s in statuses:
        r = s.record
        bar = progress_bar(r, 20)
        eta = "no worker" if s.unserved else "refused" if s.refused_now else duration(s.eta_s)
        out.append(f"{r.id:<28} {r.state.value:<11} {bar:<44} {s.tokens_per_s:>8.0f} {eta:>7}")
    return "\n".join(out)


@click.command("status")
@click.argument("job_id", required=False)
@click.option(
    "--watch", is_flag=True, help="Redraw every second until the job ends (Ctrl-C stops)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@redis_option
@handles_errors
def status(job_id: str | None, watch: bool, as_json: bool, redis_url: str | None) -> None:
    """Show JOB_ID's state, counts, tokens, speed, ETA and live workers; all jobs without one.

    States: queued, running, finalizing, completed, cancelling, cancelled (failed
    requests are error rows of their job). A job that every live worker refused (it
    holds other weights under the model's name) reads running  [refused: ...], and
    its refused line says why. While Redis refuses writes (out of memory, a failed snapshot, a replica) an outage line
    comes first and says why (on stderr with --json).
    """
    from batchgen.jobs.ops.status_report import all_statuses, job_status
    from batchgen.jobs.redis.outage_probe import refused_writes
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    if job_id:
        check_job_id(job_id)
    warned = False
    while True:
        if job_id:
            s = job_status(conn, keys, job_id)
            text = json.dumps(s.to_dict()) if as_json else _render(s)
            finished = s.record.state.terminal
            late = s.to_dict()["deadline"]
            if late and late["state"] == "late" and not late["expire"] and not warned:
                warned = True
                click.echo(f"batchgen: warning: job {job_id} is past its deadline and keeps "
                           "running (it was submitted without --expire); `batchgen cancel "
                           f"{job_id}` stops it, its finished rows kept", err=True)  # fmt: skip
        else:
            statuses = all_statuses(conn, keys)
            text = json.dumps([x.to_dict() for x in statuses]) if as_json else _table(statuses)
            finished = all(x.record.state.terminal for x in statuses)
        outage = refused_writes(conn, keys)
        if outage and as_json:
            click.echo(f"batchgen: warning: {outage}", err=True)
        elif outage:
            text = f"outage     {outage}\n{text}"
        if watch and not as_json and sys.stdout.isatty():
            click.clear()
        click.echo(text)
        if not watch or finished:
            return
        try:
            time.sleep(1.0)
        except KeyboardInterrupt:
            return
