"""Cancel stops work for real: no request of the job starts after it, in-flight ones
stop before the next step, and nothing is left in the output that the manifest does
not list."""

from __future__ import annotations

import json
import time

from batchgen.jobs.redis.keys import text
from tests.chaos.harness import OK_REASONS, Chaos, prompt_lines, wait_until


def cancel_seen(chaos: Chaos, names: list[str], job_id: str) -> dict[str, int] | None:
    """worker -> unix ms it applied the cancel (from its heartbeat), once all have."""
    seen = {}
    for name in names:
        beat = chaos.heartbeat(name)
        if not beat or job_id not in beat.get("cancels", {}):
            return None
        seen[name] = int(beat["cancels"][job_id])
    return seen


def test_after_cancel_nothing_starts_in_flight_stops_within_a_step_no_orphans(chaos, reference):
    # paced (a step >= 30 ms, a row >= 1.9 s, the job >= 10 s on 8 slots) so that the
    # CLI's cancel (a process start) lands mid-job however fast the machine: sized in
    # tokens alone, each faster engine had made all 40 before it did
    lines = prompt_lines(40, "cx", max_tokens=(64, 96))
    out = chaos.submit("cx", lines)
    names = ["w0", "w1"]
    for name in names:  # polling once in 10 minutes: the published cancel must do it
        chaos.loop_worker(name, max_num_seqs=4, cancel_poll_s=600.0, step_s=0.03)
    wait_until(lambda: chaos.record("cx").done >= 4, 180, "the first rows")
    result = chaos.cli("cancel", "cx")
    assert result.returncode == 0 and result.stdout == "cx cancelling (a worker finalizes it)\n"
    cancelled_at = int(time.time() * 1000)
    seen = wait_until(lambda: cancel_seen(chaos, names, "cx"), 30, "both workers to apply it")
    assert all(ms - cancelled_at < 5_000 for ms in seen.values()), (seen, cancelled_at)

    # the workers drop every queued entry of the job; nothing is left pending
    wait_until(lambda: chaos.conn.xlen(chaos.qk.stream) == 0 and chaos.pending() == 0, 60,
               "the job's entries to be dropped")  # fmt: skip
    assert chaos.finalized("cx") == "cancelled"

    rows = chaos.result("cx")
    assert rows["index"] == list(range(40))
    made = [i for i, reason in enumerate(rows["finish_reason"]) if reason in OK_REASONS]
    assert len(made) == chaos.record("cx").done and 4 <= len(made) < 40
    assert set(rows["finish_reason"]) <= {*OK_REASONS, "cancelled"}
    ref = reference(lines)
    for i in made:
        assert rows["token_ids"][i] == ref.token_ids[i]
        # made no later than the step under way when its worker learned of the cancel
        finished_ms = rows["finished_at"][i].timestamp() * 1000
        assert finished_ms <= seen[rows["worker"][i]] + 1, (i, rows["worker"][i])

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"] == ["result.parquet"]
    assert sorted(p.name for p in out.iterdir()) == [
        "batchgen-job.json", "manifest.json", "result.parquet"
    ]  # fmt: skip
    # late commits were refused and their parts removed; the job left the cancelled set
    # once none of its entries remained
    wait_until(lambda: not chaos.conn.smembers(chaos.qk.cancelled), 30, "the cancelled set")
    assert not [text(k) for k in chaos.conn.hkeys(chaos.qk.job("cx").parts)]
