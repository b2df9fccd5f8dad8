"""The dashboard in a real headless browser (Debian's ``chromium``; ``.ci/run`` installs it):
log in, watch a running job's progress bar move and reach 100%, click its id as a person
does (its detail, output and tok/s agree with `batchgen status` and the chart), cancel a
waiting job with its button, no console error; the outage line while Redis refuses writes;
a job the live worker refused reads refused, with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from openai import OpenAI

from batchgen.jobs.ops.submission import submit
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.cdp import Browser, find_chromium
from tests.serve_stack import KEY, Stack
from tests.test_refused_job import KEYS, refuse
from tests.test_refused_job import model as model  # fixture

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs a headless browser: Debian's chromium package (apt-get install -y chromium), "
    "which .ci/run installs",
)


@pytest.fixture
def stack(redis_url: str, tmp_path: Path, toy_model) -> Iterator[Stack]:
    stack = Stack(redis_url, tmp_path)
    try:
        # an admin key: the dashboard shows it the CLI's jobs too (another key would not)
        (tmp_path / "keys.txt").write_text(f"{KEY} ops admin\n")
        stack.serve("--keys-file", str(tmp_path / "keys.txt"), "--refresh", "0.3", "--sample", "1")
        stack.worker(toy_model("llama"), "--max-num-seqs", "2")
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    assert CHROMIUM is not None
    browser = Browser(CHROMIUM, tmp_path / "chromium-profile", tmp_path / "chromium.log")
    try:
        yield browser
    finally:
        browser.close()


def shown_detail(page) -> dict[str, str]:
    """The job detail's fields as the page shows them."""
    return page.evaluate("Object.fromEntries([...document.querySelectorAll('#detail dt')]"
                         ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]))")  # fmt: skip


def log_in(page, stack: Stack) -> None:
    """The login form filled with the key and sent, as a person does; the jobs page up."""
    page.send("Page.navigate", url=stack.base + "/")
    page.wait_for("document.readyState === 'complete' && !!document.getElementById('login')")
    page.evaluate(f"document.getElementById('key').value = {json.dumps(KEY)};"
                  "document.getElementById('login').submit()")  # fmt: skip
    page.wait_for("!!document.querySelector('#jobs') && document.readyState === 'complete'")


def status_of(stack: Stack, job_id: str) -> dict:
    """What `batchgen status JOB --json` says."""
    out = subprocess.run([sys.executable, "-m", "batchgen", "status", job_id, "--json", "--redis",
                          stack.redis_url], capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout)


def test_dashboard_shows_a_job_progress_to_100_percent(stack, browser, toy_model, tmp_path):
    page = browser.page
    for domain in ("Runtime", "Log", "Page"):
        page.send(f"{domain}.enable")
    log_in(page, stack)
    cookie = page.send("Network.getCookies")["cookies"][0]
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == (
        "batchgen_session", True, "Strict")  # fmt: skip
    assert KEY not in cookie["value"]  # a session token, never the key

    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    rows = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": str(toy_model("llama")), "prompt": f"count to {i}",
                      "max_tokens": 64}} for i in range(40)]  # fmt: skip
    # (long enough, about 2,500 tokens at 2 at a time, that rows are committed in several
    # parts: at 24 tokens an idle machine finished it between two refreshes)
    path = tmp_path / "dash.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with path.open("rb") as f:
        file = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip

    bar = f"document.querySelector('[data-job=\"{batch.id}\"] .bar')"
    seen: list[int] = []
    deadline = time.monotonic() + 300
    while not seen or seen[-1] < 100:
        assert time.monotonic() < deadline, f"progress stuck at {seen[-5:]}"
        pct = page.evaluate(f"{bar} ? Number({bar}.dataset.pct) : null")
        if pct is not None and (not seen or pct != seen[-1]):
            seen.append(pct)
        time.sleep(0.1)
    assert seen == sorted(seen), seen
    assert any(0 < p < 100 for p in seen), f"the bar never showed a value between: {seen}"
    assert page.evaluate(f"{bar}.firstChild.style.width") == "100%"

    # a person's click on the job id, held across a refresh (every 0.3 s here): the row
    # under the mouse must be the same element when the button comes up
    page.click(f'[data-job="{batch.id}"] td', hold_s=0.8)
    page.wait_for("!document.getElementById('detail').hidden")
    page.wait_for("document.getElementById('detail').textContent.includes('40 / 0 / 0 / 40')")
    page.wait_for("document.querySelector('#detail dd').textContent === 'completed'")  # final
    detail = shown_detail(page)
    assert detail["output"] == str(stack.tmp / "out" / batch.id)
    # its tok/s is `batchgen status`'s, and no more than the fleet's chart ever showed
    status = status_of(stack, batch.id)
    assert float(detail["tok/s"]) == status["tokens_per_s"] > 0
    series = page.evaluate("fetch('/api/series').then(r => r.json())")
    peak = max(point["fleet"] for point in series)
    assert status["tokens_per_s"] <= peak, (status, [p["fleet"] for p in series])
    workers = page.evaluate("[...document.querySelectorAll('#workers tbody tr')]"
                            ".map(r => r.children[3].textContent)")  # fmt: skip
    assert workers == ["cpu"]
    page.wait_for("document.querySelectorAll('#legend span').length >= 2")  # fleet + the job

    # a job no worker serves: its detail has its output and a cancel button that works
    unserved = tmp_path / "unserved"
    unserved.symlink_to(toy_model("llama"))
    (tmp_path / "wait.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    submitted = subprocess.run(
        [sys.executable, "-m", "batchgen", "submit", str(tmp_path / "wait.jsonl"), "--model",
         str(unserved), "--job-id", "waits", "--output", str(tmp_path / "waits"), "--redis",
         stack.redis_url], capture_output=True, text=True)  # fmt: skip
    assert (submitted.returncode, submitted.stdout) == (0, "waits\n"), submitted.stderr
    page.wait_for("!!document.querySelector('[data-job=\"waits\"]')")
    page.click('[data-job="waits"] td')
    page.wait_for("document.getElementById('detail').textContent.includes('Job waits')")
    detail = shown_detail(page)
    assert (detail["state"], detail["output"], detail["ETA"]) == (
        "queued", str(tmp_path / "waits"), "– (no live worker serves the model)")  # fmt: skip
    page.click("#detail button.danger")
    assert page.dialogs == ["Cancel job waits? Finished rows are kept."]
    page.wait_for("document.querySelector('#detail dd').textContent === 'cancelling'")
    assert page.evaluate("document.querySelector('#detail button.danger')") is None
    status = status_of(stack, "waits")
    assert status["state"] == "cancelling"  # the worker of its model would finalize it
    finalized = subprocess.run([sys.executable, "-m", "batchgen", "finalize", "waits", "--redis",
                                stack.redis_url], capture_output=True, text=True)  # fmt: skip
    assert finalized.returncode == 0, finalized.stderr
    # its rows are cancelled ones, not failed ones, in the detail and in the table
    page.wait_for("document.querySelector('#detail dd').textContent === 'cancelled'")
    assert shown_detail(page)["done / failed / cancelled / total"] == "0 / 0 / 2 / 2"
    cells = page.evaluate("[...document.querySelector('[data-job=\"waits\"]').children]"
                          ".map(td => td.textContent)")  # fmt: skip
    assert cells[4:8] == ["0", "0", "2", "2"]  # done, failed, cancelled, total
    # its bar: no row done (0%), the cancelled ones a segment of their own, not a full bar
    waits_bar = "document.querySelector('[data-job=\"waits\"] .bar')"
    widths = page.evaluate(f"[...{waits_bar}.querySelectorAll('span')].map(s => s.style.width)")
    assert widths == ["0%", "0%", "100%"]  # done, failed, cancelled
    assert page.evaluate(f"{waits_bar}.dataset.pct + ' ' + {waits_bar}.textContent") == "0 0%"

    shot = page.screenshot(tmp_path / "dashboard.png")
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    assert page.console_errors() == []


def test_the_page_says_when_redis_refuses_writes(private_redis, browser, tmp_path):
    """/api/overview's outage line (`batchgen status`'s) shows at the top of the page while
    Redis refuses writes (OOM here), and goes once it takes them again. No worker needed."""
    stack = Stack(private_redis.url, tmp_path)
    admin = redis.Redis.from_url(private_redis.url)
    try:
        (tmp_path / "keys.txt").write_text(f"{KEY} ops admin\n")
        stack.serve("--keys-file", str(tmp_path / "keys.txt"), "--refresh", "0.3")
        page = browser.page
        log_in(page, stack)
        assert page.evaluate("document.getElementById('outage').hidden") is True
        admin.config_set("maxmemory", 1)
        try:
            page.wait_for("!document.getElementById('outage').hidden")
            shown = page.evaluate("document.getElementById('outage').textContent")
        finally:
            admin.config_set("maxmemory", 0)
        assert shown.startswith("Redis refuses writes (OOM: command not allowed when used "
                                "memory > 'maxmemory'.); workers and serve wait")  # fmt: skip
        page.wait_for("document.getElementById('outage').hidden")
    finally:
        stack.stop()


def test_the_page_says_a_refused_job_is_refused(redis_url, browser, tmp_path, model):
    """A job the live worker refused (it holds other weights under the model's name:
    tests/test_refused_job.py) reads refused in the table's ETA and in its detail, with
    the worker's reason, as `batchgen status` says it. No engine needed."""
    stack = Stack(redis_url, tmp_path)
    conn = redis.Redis.from_url(redis_url)
    try:
        (tmp_path / "keys.txt").write_text(f"{KEY} ops admin\n")
        stack.serve("--keys-file", str(tmp_path / "keys.txt"), "--refresh", "0.3")
        (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(4)))
        submit(conn, KEYS, source_path=str(tmp_path / "p.jsonl"), model=str(model),
               output=str(tmp_path / "out"), defaults=dict(DEFAULTS), job_id="fp")  # fmt: skip
        reason = refuse(conn, model, "fp")
        page = browser.page
        log_in(page, stack)
        row = "document.querySelector('[data-job=\"fp\"]')"
        page.wait_for(f"!!{row}")
        cells = page.evaluate(f"[...{row}.children].map(td => td.textContent)")
        assert (cells[2], cells[9]) == ("running", "refused")  # state, ETA
        page.click('[data-job="fp"] td')
        page.wait_for("document.getElementById('detail').textContent.includes('Job fp')")
        detail = shown_detail(page)
        assert (detail["state"], detail["ETA"], detail["refused"]) == (
            "running", "– (refused by the live workers: see refused)", reason)  # fmt: skip
    finally:
        stack.stop()
