"""The fleet-on-namespaces scenario of tests/chaos/test_hosts.py, bigger: Redis, the
S3 store, the CLI and N workers each on a host (network namespace) of its own; one
worker host is cut off mid-job past the claim timeout, then reconnected. Checks
exactly one row per line with tokens equal to a fault-free run, and prints how long
the cut lasted and the job took. Needs root and iproute2. Run from the repo root:

    .venv/bin/python -m benchmarks.fleet_hosts --workers 4 --lines 120
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from batchgen.toy import write_toy_checkpoint
from tests.chaos.fleet import cut_one_worker, fleet
from tests.chaos.harness import assert_exactly_once, prompt_lines
from tests.chaos.reference import fault_free
from tests.netns import unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--claim-timeout", type=float, default=3.0)
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"fleet_hosts {reason}")
    workers = [f"w{k + 1}" for k in range(args.workers)]
    lines = prompt_lines(args.lines, "fleet", max_tokens=(16, 64))
    with tempfile.TemporaryDirectory(prefix="batchgen-fleet-") as folder:
        tmp = Path(folder)
        model = write_toy_checkpoint(tmp / "model", arch="llama", size="tiny")
        from batchgen import Engine

        expected = fault_free(Engine.from_pretrained(model, device="cpu"), model, lines)
        with fleet(tmp, model, workers) as chaos:
            report = cut_one_worker(chaos, "fleet", lines, workers, args.claim_timeout)
            started = time.monotonic()
            rows = chaos.result("fleet")
            download_s = time.monotonic() - started
            assert_exactly_once(rows, lines, expected)
            per_worker = {w: rows["worker"].count(w) for w in workers}
    result = {
        "lines": args.lines, "workers": args.workers, "claim_timeout_s": args.claim_timeout,
        "held_by_cut_worker": len(report.held), "cut_s": round(report.cut_s, 1),
        "job_s": round(report.total_s, 1), "download_s": round(download_s, 1),
        "rows_per_worker": per_worker, "exactly_once": True,
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
