"""The dashboard in a real headless browser (Debian's ``chromium``; ``.ci/run`` installs it):
log in, watch a running job's progress bar move and reach 100%, no console error."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.cdp import Browser, find_chromium
from tests.serve_stack import KEY, Stack

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
        stack.serve("--api-key", KEY, "--refresh", "0.3", "--sample", "1")
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


def test_dashboard_shows_a_job_progress_to_100_percent(stack, browser, toy_model, tmp_path):
    page = browser.page
    for domain in ("Runtime", "Log", "Page"):
        page.send(f"{domain}.enable")
    page.send("Page.navigate", url=stack.base + "/")
    page.wait_for("document.readyState === 'complete' && !!document.getElementById('login')")
    page.evaluate(f"document.getElementById('key').value = {json.dumps(KEY)};"
                  "document.getElementById('login').submit()")  # fmt: skip
    page.wait_for("!!document.querySelector('#jobs') && document.readyState === 'complete'")
    cookie = page.send("Network.getCookies")["cookies"][0]
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == (
        "batchgen_session", True, "Strict")  # fmt: skip
    assert KEY not in cookie["value"]  # a session token, never the key

    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    rows = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": str(toy_model("llama")), "prompt": f"count to {i}",
                      "max_tokens": 24}} for i in range(40)]  # fmt: skip
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

    page.evaluate(f"document.querySelector('[data-job=\"{batch.id}\"]').click()")
    page.wait_for("!document.getElementById('detail').hidden")
    page.wait_for("document.getElementById('detail').textContent.includes('40 / 0 / 40')")
    workers = page.evaluate("[...document.querySelectorAll('#workers tbody tr')]"
                            ".map(r => r.children[3].textContent)")  # fmt: skip
    assert workers == ["cpu"]
    page.wait_for("document.querySelectorAll('#legend span').length >= 2")  # fleet + the job

    shot = page.screenshot(tmp_path / "dashboard.png")
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    assert page.console_errors() == []
